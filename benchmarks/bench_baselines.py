"""Step time of the compression baselines relative to D-Lion, side by side in one process.

One step = (TernGrad's scaler pre-exchange) + 8 worker rules + the server rule + the apply rule on
a 10M-parameter fp32 buffer of 20 tensors (16 weight matrices, 4 small vectors). Repetitions are
interleaved across methods so load from other processes hits all of them alike; medians are
reported. DGC runs past its warm-up (99.9% sparsity), the steady state of a run. Single-threaded,
so the ratios compare the work each method does rather than thread scheduling.
"""

from __future__ import annotations

import statistics
import time

import torch

from distlion.comm.exchange import InProcessExchange
from distlion.flat import Segment
from distlion.methods import build_method
from distlion.methods.base import Method, StepContext
from distlion.methods.step import BufferWorkers, algorithm1_step

NUM_WORKERS = 8
REPEATS = 3
# 16 weight matrices of 625 x 999 and 4 vectors of 2500 (biases, norms): 10M parameters.
LAYOUT = [Segment(f"w{i}", i * 624_375, 624_375, (625, 999)) for i in range(16)] + [
    Segment(f"b{i}", 9_990_000 + i * 2_500, 2_500, (2_500,)) for i in range(4)
]
NUMEL = LAYOUT[-1].stop
METHODS = {
    "dlion": {"lr": 1e-4},
    "dgc": {},
    "terngrad": {},
    "graddrop": {},
}


def step(method: Method, grads: torch.Tensor, states: list[dict], ctx: StepContext) -> None:
    """One step of the runner's loop, all workers in this process."""
    local = BufferWorkers([method] * NUM_WORKERS, states)
    algorithm1_step({grads.dtype: local}, {grads.dtype: grads}, ctx, InProcessExchange(NUM_WORKERS))


def run() -> list[dict]:
    # One thread: on a shared machine, intra-op threads waiting on each other distort the ratios.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure()
    finally:
        torch.set_num_threads(threads)


def measure() -> list[dict]:
    grads = torch.randn(NUM_WORKERS, NUMEL, generator=torch.Generator().manual_seed(0))
    bound = {}
    for name, hparams in METHODS.items():
        method = build_method(name, **hparams).bind(torch.zeros(NUMEL), NUM_WORKERS, LAYOUT)
        bound[name] = (method, [method.init_worker_state() for _ in range(NUM_WORKERS)])
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for rep in range(REPEATS + 1):
        ctx = StepContext(step=rep, lr=1e-4, num_workers=NUM_WORKERS, epoch=10.0)
        for name, (method, states) in bound.items():
            start = time.perf_counter()
            step(method, grads, states, ctx)
            if rep:  # the first repetition warms up allocations
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["dlion"])
    rows = []
    for name in METHODS:
        if name == "dlion":
            continue
        median = statistics.median(times[name])
        rows.append(
            {
                "name": f"{name}_step_time_vs_dlion",
                "value": median / base,
                "unit": "x",
                "target": None,
                "detail": (
                    f"median of {REPEATS} steps: {name} {median * 1e3:.0f} ms, dlion {base * 1e3:.0f} ms; "
                    f"{NUMEL / 1e6:.0f}M fp32 params in {len(LAYOUT)} tensors, N={NUM_WORKERS}, 1 thread"
                ),
            }
        )
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
