"""torch.distributed backend, 4 gloo ranks on loopback: wire bytes per method against the paper's
formula, and the step time of D-Lion MaVo against G-AdamW's fp32 all-reduce on 10.5M parameters.

`run()` launches `torchrun --nproc-per-node 4` on this file (each rank runs `worker`) and reads what
rank 0 wrote. The step is the cluster's `step` given fixed random gradients: worker rule, exchange
and apply; forward and backward are the same for both methods and left out. 4 processes share the
2 cores here, so the times order the methods rather than predict a real network.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

RANKS = 4
LIMIT_S = 300
# Per method: hyperparameters, and the paper's bits per parameter (up, down), or None for the sparse
# methods, whose formula is 64 bits per kept entry all-gathered.
WIRE_METHODS = {
    "dlion": ({"aggregation": "mavo"}, (1, 1)),
    "dlion_avg": ({"aggregation": "avg"}, (1, math.ceil(math.log2(RANKS + 1)))),
    "adamw": ({}, (32, 32)),
    "lion": ({}, (32, 32)),
    "terngrad": ({}, (2, math.ceil(math.log2(2 * RANKS + 1)))),
    "dgc": ({"warmup_epochs": 0, "exact_topk": True}, None),
    "graddrop": ({}, None),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", __file__, str(out)]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"torchrun failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
        return json.loads(out.read_text())


def _mlp(widths: list[int]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)])


def _grads(flat, rank: int) -> dict[torch.dtype, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {d: torch.randn(1, b.numel(), generator=g) for d, b in flat.buffers.items()}


def _wire_rows(rank: int) -> list[dict]:
    from distlion.cluster.torchdist import TorchDistCluster
    from distlion.flat import FlatParams
    from distlion.methods import build_method

    rows = []
    for name, (hparams, paper_bits) in WIRE_METHODS.items():
        flat = FlatParams(_mlp([512, 1024, 512, 256]))  # 1.18M parameters: 3 weight matrices and 3 biases
        method = build_method(name.removesuffix("_avg"), **hparams)
        cluster = TorchDistCluster(method, flat, RANKS, timeout_s=120)
        grads = _grads(flat, rank)
        for step in range(3):
            bits = cluster.step(grads, step=step, lr=1e-4, epoch=1.0)
        n = flat.numel
        layout = flat.layouts[torch.float32]
        if paper_bits is not None:
            # Sharded server (or ring all-reduce): 1/N of each message stays on the rank; sent = received.
            formula = 2 * (RANKS - 1) / RANKS * sum(paper_bits) * n / 8
            how = f"2 (N-1)/N x ({paper_bits[0]} + {paper_bits[1]}) bits x n"
            if name == "terngrad":  # one fp32 scaler per layer each way, all-gathered
                formula += 2 * (RANKS - 1) * 4 * len(layout)
                how += " + 2 (N-1) x 32 bits x layers"
        else:
            if name == "dgc":  # top 0.1% of each weight matrix, biases dense fp32
                kept = sum(math.ceil(s.numel * 0.001 - 1e-9) for s in layout if s.is_matrix)
                dense = sum(s.numel for s in layout if not s.is_matrix)
                bits_up = 64 * kept + 32 * dense
                how = "2 (N-1) x (64 k + 32 n_bias) bits, k = 0.1% of each matrix"
            else:  # top 1% of the whole buffer
                bits_up = 64 * math.ceil(n * 0.01 - 1e-9)
                how = "2 (N-1) x 64 k bits, k = 1% of n"
            how += "; no downlink on the wire: every rank runs the server rule"
            formula = 2 * (RANKS - 1) * bits_up / 8
        measured = bits.wire.total
        rows.append({
            "name": f"torchdist wire bytes/step/rank, {name}, N={RANKS}",
            "value": measured,
            "unit": "bytes",
            "target": "1.00-1.01 x formula",
            "detail": f"{measured / formula:.4f} x formula {formula:.0f} = {how} (n = {n}); "
                      f"{8 * measured / n:.3f} bits/param sent+received; payload up {bits.up[rank] / n:.3f}, "
                      f"down {bits.down / n:.3f} bits/param",
        })
    return rows


def _step_time_rows(rank: int, repeats: int = 7) -> list[dict]:
    from distlion.cluster.torchdist import TorchDistCluster
    from distlion.flat import FlatParams
    from distlion.methods import build_method

    clusters, grads = {}, None
    for name, hparams in (("dlion", {"aggregation": "mavo"}), ("adamw", {})):
        flat = FlatParams(_mlp([1024] * 11))  # 10 layers of 1024 x 1024 + biases: 10.5M parameters
        clusters[name] = TorchDistCluster(build_method(name, **hparams), flat, RANKS, timeout_s=120)
        grads = grads or _grads(flat, rank)
    comm = clusters["dlion"].backend.comm
    times = {name: [] for name in clusters}
    for rep in range(repeats + 1):
        order = list(clusters) if rep % 2 else list(reversed(clusters))
        for name in order:
            comm.barrier()
            start = time.perf_counter()
            clusters[name].step(grads, step=rep, lr=1e-4)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            if rep:  # the first repetition warms up
                times[name].append(comm.all_reduce(elapsed, op="max").item())  # the slowest rank's step
    dlion, adamw = (statistics.median(times[name]) for name in ("dlion", "adamw"))
    n = clusters["dlion"].flat.numel
    return [{
        "name": f"torchdist step time dlion MaVo / adamw all-reduce, N={RANKS}, {n / 1e6:.1f}M params",
        "value": dlion / adamw,
        "unit": "x",
        "target": "< 1",
        "detail": f"median of {repeats} (slowest rank): dlion {1e3 * dlion:.0f} ms, adamw {1e3 * adamw:.0f} ms; "
                  f"gloo loopback, {RANKS} ranks on {os.cpu_count()} cores",
    }]


def worker(out: str) -> None:
    rank = int(os.environ["RANK"])
    rows = _wire_rows(rank) + _step_time_rows(rank)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        worker(sys.argv[1])
    else:
        for row in run():
            print(f"{row['name']}: {row['value']:.4g} {row['unit']} ({row['detail']})")
