"""Step time on a link of a given bandwidth: T_step = T_compute + T_codec + T_comm, less what overlaps.

T_comm is the alpha-beta model of the collectives a method's exchange makes (`distlion.comm.exchange`),
from the bytes each rank puts on its own link (a switched network: every worker has its own full-duplex
link, as under `distlion-netem`):

    ring all-reduce of B bytes      2(N-1) rounds, 2(N-1)/N x B per rank     (mean; DDP's hooks)
    all-to-all of B bytes            N-1 rounds,   (N-1)/N x B per rank      (sharded: the uplink)
    all-gather of b bytes per rank   N-1 rounds,   (N-1) x b per rank        (sharded: the downlink; allgather)

    time = rounds x alpha + bytes / bandwidth

A `Calibration` holds a method's measured compute, codec (encode + apply) and communication times from a
short run on a reference link (the uncapped one); on another link the model keeps the reference's
communication time and adds what the link changes: the bytes at the new bandwidth instead of the
reference's, the rounds at the new latency. Methods that exchange inside backward (DDP) hide their
communication behind backward: the share the reference run hid, up to the length of backward.

`predict_scale` uses the same formulas for what one machine cannot run (ViT-B/16 and a 7B LLaMA on 8-64
GPUs at 10-400 Gbit/s), with per-worker compute times from cited public measurements: a model prediction.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

#: The ring all-reduce's bytes per rank are 2(N-1)/N of the tensor; its rounds 2(N-1).
COLLECTIVES = ("all_reduce", "all_to_all", "all_gather")


@dataclass(frozen=True)
class Link:
    """One worker's link: `bandwidth` in bit/s (None: not the bottleneck) and `alpha`, seconds per round."""

    bandwidth: float | None
    alpha: float = 0.0

    def seconds(self, rounds: float, nbytes: float) -> float:
        return rounds * self.alpha + (8 * nbytes / self.bandwidth if self.bandwidth else 0.0)


@dataclass(frozen=True)
class Transfer:
    """One collective of a step: its kind and the payload (all-reduce, all-to-all: the tensor each rank holds;
    all-gather: each rank's piece), in bytes; `calls` of them (DDP: one per bucket)."""

    kind: str
    payload: float
    calls: int = 1

    def rounds(self, n: int) -> int:
        return self.calls * (2 * (n - 1) if self.kind == "all_reduce" else n - 1)

    def bytes_per_rank(self, n: int) -> float:
        if self.kind == "all_reduce":
            return 2 * (n - 1) / n * self.payload
        if self.kind == "all_to_all":
            return (n - 1) / n * self.payload
        if self.kind == "all_gather":
            return (n - 1) * self.payload
        raise ValueError(f"collective {self.kind!r} is not one of {COLLECTIVES}")


def transfers(exchange: str, up_bits: float, down_bits: float, n: int, buckets: int = 1) -> list[Transfer]:
    """A step's collectives for an exchange kind with `up_bits` / `down_bits` per worker (all parameters)."""
    if exchange in ("mean", "in_backward"):
        return [Transfer("all_reduce", up_bits / 8, calls=buckets)]
    if exchange == "sharded":  # all-to-all of the uplink, all-gather of each rank's 1/N of the downlink
        return [Transfer("all_to_all", up_bits / 8), Transfer("all_gather", down_bits / 8 / n)]
    if exchange == "allgather":
        return [Transfer("all_gather", up_bits / 8)]
    raise ValueError(f"exchange {exchange!r} has no cost model")


def comm_seconds(steps: list[Transfer], n: int, link: Link) -> float:
    return sum(link.seconds(t.rounds(n), t.bytes_per_rank(n)) for t in steps)


@dataclass(frozen=True)
class Calibration:
    """One method's measured step on a reference link: seconds per step of each phase, and its collectives."""

    method: str
    workers: int
    compute: float
    codec: float
    comm: float
    hidden: float
    transfers: tuple[Transfer, ...]
    overlaps: bool = False

    @property
    def backward(self) -> float:
        """The part of compute communication can hide behind: backward, about 2/3 of forward + backward."""
        return 2 / 3 * self.compute

    def step(self, link: Link, reference: Link) -> dict[str, float]:
        """Predicted seconds per step on `link`, phase by phase."""
        n = self.workers
        steps = list(self.transfers)
        comm = self.comm + comm_seconds(steps, n, link) - comm_seconds(steps, n, reference)
        comm = max(comm, 0.0)
        # The reference hid this share of its communication; a slower link hides the same share of more
        # communication, until backward is fully covered.
        share = self.hidden / self.comm if self.overlaps and self.comm > 0 else 0.0
        hidden = min(share * comm, max(self.backward, self.hidden))
        return {"compute": self.compute, "codec": self.codec, "comm": comm, "hidden": hidden,
                "step": self.compute + self.codec + comm - hidden}


def calibrate_times(method: str, times: dict[str, Any], workers: int) -> Calibration:
    """A method's calibration from its measured seconds per step (`compute`, `encode`, `comm`, `comm_hidden`,
    `apply`), its exchange and its bits per step (`up`, `down`: all parameters, one worker)."""
    exchange = times["exchange"]
    # DDP's buckets: 25 MB each (the payload's fp32 size sets how many rings run)
    buckets = max(1, round(times["up"] / 8 / 25e6)) if exchange == "in_backward" else 1
    return Calibration(method, workers, compute=times["compute"], codec=times["encode"] + times["apply"],
                       comm=times["comm"], hidden=times.get("comm_hidden", 0.0),
                       transfers=tuple(transfers(exchange, times["up"], times["down"], workers, buckets)),
                       overlaps=exchange == "in_backward")


def steady_lines(summary: dict[str, Any], lines: list[dict[str, Any]], skip: int = 2) -> list[dict[str, Any]]:
    """A run's timed metrics lines in its steady state: from its method's `start_iter` on (PowerSGD all-reduces
    fp32 gradients before it; 10 of a 30-step run would be a third of its mean), then the first `skip` left out
    (start-up, DDP's bucket rebuild)."""
    start = int(summary.get("method.start_iter") or 0)
    timed = [line for line in lines if "time_step" in line and line["step"] >= start]
    return timed[skip:] if len(timed) > skip else timed


def calibrate(run_dir: Path, skip: int = 2) -> Calibration:
    """A method's calibration from a finished run: its phase times averaged over its steady state's logged
    steps (`steady_lines`), its bits per step as measured."""
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = steady_lines(summary, lines, skip)
    if not timed:
        raise ValueError(f"{run_dir}: no step times in metrics.jsonl (a run from before time_* was logged)")
    params = summary["num_params"]
    times = {key: statistics.fmean(line.get(f"time_{key}", 0.0) for line in timed)
             for key in ("compute", "encode", "comm", "comm_hidden", "apply")}
    times["up"] = statistics.fmean(line["bits_up_per_param"] for line in timed) * params
    times["down"] = statistics.fmean(line["bits_down_per_param"] for line in timed) * params
    times["exchange"] = summary.get("exchange") or _EXCHANGE.get(summary["method"], "mean")
    return calibrate_times(summary["method"], times, summary["workers"])


# How each registered method class exchanges (its `Method.exchange`), for runs that did not record it.
_EXCHANGE = {"adamw": "mean", "lion": "mean", "dlion": "sharded", "signum": "sharded", "terngrad": "sharded",
             "dgc": "allgather", "graddrop": "allgather", "ddp": "in_backward"}


def rescaled(calibration: Calibration, workers: int, params_ratio: float = 1.0) -> Calibration:
    """The same method with another worker count and `params_ratio` times the payload (the model changes)."""
    steps = tuple(replace(t, payload=t.payload * params_ratio) for t in calibration.transfers)
    return replace(calibration, workers=workers, transfers=steps)


def speedup(baseline: dict[str, float], method: dict[str, float]) -> float:
    return baseline["step"] / method["step"] if method["step"] > 0 else math.inf


def summary_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A Markdown table of dict rows."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"
