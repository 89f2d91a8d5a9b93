"""Step time on emulated links (issue 14): 2 torchrun ranks (one per core: 4 on 2 cores time the contention for
the cores, not the link), each in its own network namespace on its own link
(distlion-netem) of 100 Mbit/s, 1 Gbit/s or uncapped, a 10.5M-parameter MLP, forward + backward + step.

- D-Lion MaVo against G-AdamW as users run it (DDP, fp32 all-reduce overlapped with backward, then AdamW);
- D-Lion capped against uncapped, after backward (`dlion`) and as DDP's comm hook inside it (`dlion_ddp`): how
  close to free its communication is. It can be close only where the exchange is shorter than the compute it
  can hide behind, so the target applies there (the row says which);
- the cost model (`distlion.costmodel`) calibrated on the uncapped runs, against the capped ones.

Needs root (network namespaces); without it every row says why it was not measured. CPU compute is slow, so a
given link is, relative to it, a faster one on a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

RANKS = 2
RATES = ("none", "1gbit", "100mbit")
METHODS = ("dlion", "dlion_ddp", "ddp")
BATCH = 32  # rows per rank: little compute per step, so that the link matters as on a fast GPU
REPEATS = 5


def run() -> list[dict]:
    from distlion.costmodel import Link, calibrate_times
    from distlion.netem import NetemError, links, measure_rate, rank_commands, run_ranks, unavailable_reason

    reason = unavailable_reason()
    if reason:
        return [{"name": "links: step times", "value": float("nan"), "unit": "x", "target": "",
                 "detail": f"not measured: {reason}"}]
    times, measured = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for rate in RATES:
            out = Path(tmp) / f"{rate}.json"
            try:
                with links(RANKS, rate) as topology:
                    measured[rate] = measure_rate(topology)
                    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}", __file__,
                               str(out)]
                    code = run_ranks(rank_commands(command, topology))
            except NetemError as err:
                return [{"name": "links: step times", "value": float("nan"), "unit": "x", "target": "",
                         "detail": f"not measured: {err}"}]
            if code:
                raise RuntimeError(f"the {rate} ranks failed with exit status {code}")
            times[rate] = json.loads(out.read_text())
    rows = []
    for rate in ("100mbit", "1gbit"):
        dlion, ddp = times[rate]["dlion"]["step"], times[rate]["ddp"]["step"]
        rows.append({"name": f"links: DDP fp32 AdamW / D-Lion MaVo step time, {rate}, N={RANKS}",
                     "value": ddp / dlion, "unit": "x", "target": ">= 3 at 100mbit",
                     "detail": f"ddp {1e3 * ddp:.0f} ms, dlion {1e3 * dlion:.0f} ms per step (median of {REPEATS}, "
                               f"slowest rank); link measured {measured[rate] / 1e6:.0f} Mbit/s"})
    for name in ("dlion", "dlion_ddp"):
        for rate in ("100mbit", "1gbit"):
            capped, free = times[rate][name], times["none"][name]
            hideable = capped["comm"] < free["compute"]
            rows.append({
                "name": f"links: {name} step time {rate} / uncapped, N={RANKS}", "value": capped["step"] / free["step"],
                "unit": "x", "target": "<= 1.3" if hideable else "none: exchange longer than compute",
                "detail": f"{1e3 * capped['step']:.0f} ms vs {1e3 * free['step']:.0f} ms; capped: exchange "
                          f"{1e3 * capped['comm']:.0f} ms ({1e3 * capped['comm_hidden']:.0f} hidden in backward), "
                          f"uncapped compute {1e3 * free['compute']:.0f} ms (uncapped measured "
                          f"{measured['none'] / 1e9:.1f} Gbit/s)"})
    reference = Link(measured["none"])
    for name in METHODS:
        model = calibrate_times(name, times["none"][name], RANKS)
        for rate in ("100mbit", "1gbit"):
            predicted = model.step(Link(measured[rate]), reference)["step"]
            actual = times[rate][name]["step"]
            rows.append({"name": f"links: cost model error, {name}, {rate}", "value": predicted / actual - 1,
                         "unit": "relative", "target": "within +-0.2",
                         "detail": f"predicted {1e3 * predicted:.0f} ms, measured {1e3 * actual:.0f} ms (calibrated "
                                   f"on the uncapped link; exchange {times['none'][name]['exchange']})"})
    return rows


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(10)])  # 10.5M parameters


def worker(out: str) -> None:
    """One rank: per method, forward + backward + the cluster's step on a fixed batch, timed; rank 0 writes."""
    from distlion.cluster.torchdist import TorchDistCluster
    from distlion.flat import FlatParams
    from distlion.methods import build_method
    from distlion.train import step_times

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    x = torch.randn(BATCH, 1024, generator=torch.Generator().manual_seed(rank))

    def loss_fn(model, inputs, targets):
        return (model(inputs) - targets).pow(2).mean(dim=1)

    results = {}
    for name in METHODS:
        model = _mlp()
        flat = FlatParams(model)
        method = build_method(name, lr=1e-4)
        cluster = TorchDistCluster(method, flat, RANKS, timeout_s=600)
        grads_fn = cluster.gradients(model, "sequential")
        samples = []
        for rep in range(REPEATS + 1):
            cluster.backend.comm.barrier()
            start = time.perf_counter()
            grads, _ = grads_fn(model, flat, loss_fn, x, x, 1)
            compute = time.perf_counter() - start
            bits = cluster.step(grads, step=rep, lr=1e-4)
            total = time.perf_counter() - start
            phases = step_times({"compute": compute}, getattr(grads_fn, "last_times", {}), bits.times, total)
            slowest = cluster.backend.comm.all_reduce(torch.tensor([total], dtype=torch.float64), op="max").item()
            if rep:  # the first one warms up (and DDP rebuilds its buckets)
                samples.append({**phases, "step": slowest, "up": bits.mean_up, "down": bits.down})
        results[name] = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
        results[name]["exchange"] = method.exchange
        results[name]["num_params"] = flat.numel
    if rank == 0:
        Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        worker(sys.argv[1])
    else:
        for row in run():
            print(f"{row['name']}: {row['value']:.4g} {row['unit']} ({row['detail']})")
