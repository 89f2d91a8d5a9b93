"""(a) One simulated D-Lion step for N=8 workers against 8 timm Lion steps, 10M parameters; and the
non-finite gradient check every step makes, as a fraction of that step. (a2) `DistributedLion` in a world of
one against timm's Lion on the same parameters, at 10M and at 100k parameters (where per-step overhead
dominates), and the bytes each allocates per step."""

from __future__ import annotations

import statistics
import time

import torch
from timm.optim import Lion
from torch.profiler import ProfilerActivity, profile

from distlion import DistributedLion, kernels
from distlion.comm.exchange import InProcessExchange
from distlion.methods import StepContext, build_method
from distlion.methods.step import BufferWorkers, algorithm1_step, nonfinite_workers

NUMEL = 10_000_000
WORKERS = 8
# DRAM bytes per parameter, for fp32 (the fused kernels keep the update in registers; the eager ops' blocks keep
# their update, mask and +-1 in cache). A timm Lion step:
# p *= 1 - lr wd (r4 w4), u = lerp(m, g) (r8 w4), sign_ (r4 w4), p += -lr u (r8 w4), m = lerp(m, g) (r8 w4).
LION_BYTES = 48.0
# The N=8 D-Lion step: per worker the finite check (r4) and the rule (r m, g; w m; w 1/8 of signs); the vote
# (r N/8, w 1/8); the apply (r x, w x, r 1/8 of the vote).
DLION_BYTES = WORKERS * (4 + 12 + 1 / 8) + (WORKERS + 1) / 8 + 8 + 1 / 8


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run(repeats: int = 7, threads: int = 1) -> list[dict]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # as the other benchmarks: shared cores make 2 threads spin-wait
    try:
        return _run(repeats) + [row for numel, tensors in ((NUMEL, 20), (100_000, 30))
                                for row in _optimizer_rows(numel, tensors, repeats)]
    finally:
        torch.set_num_threads(previous)


def _run(repeats: int) -> list[dict]:
    torch.manual_seed(0)
    grads = torch.randn(WORKERS, NUMEL)
    method = build_method("dlion", lr=1e-4, weight_decay=0.1).bind(torch.randn(NUMEL), WORKERS)
    states = [method.init_worker_state() for _ in range(WORKERS)]
    ctx = StepContext(step=0, lr=1e-4, num_workers=WORKERS)

    local, exchange = {grads.dtype: BufferWorkers([method] * WORKERS, states)}, InProcessExchange(WORKERS)

    def dlion_step():
        algorithm1_step(local, {grads.dtype: grads}, ctx, exchange)

    # Eight independent Lion optimizers, one per worker, as eight separate jobs would run them.
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(WORKERS)]
    optimizers = [Lion([p], lr=1e-4, weight_decay=0.1) for p in params]
    for p, g in zip(params, grads):
        p.grad = g

    def lion_steps():
        for opt in optimizers:
            opt.step()

    def finite_check():
        nonfinite_workers(local, {grads.dtype: grads}, exchange.local_workers)

    dlion_step(), lion_steps(), finite_check()  # warm-up
    ours, theirs, checks = [], [], []
    for _ in range(repeats):
        ours += _time(dlion_step, 1)
        theirs += _time(lion_steps, 1)
        checks += _time(finite_check, 1)
    ratio = statistics.median(ours) / statistics.median(theirs)
    check = statistics.median(checks) / statistics.median(ours)
    return [{
        "name": "(a) non-finite gradient check of 8 workers, fraction of the dlion step above (included in it)",
        "value": check, "unit": "x time", "target": None,
        "detail": f"check {statistics.median(checks) * 1e3:.0f} ms: one sum per worker's 10M gradient "
                  f"(median of {repeats}, interleaved, {torch.get_num_threads()} thread)",
    }, {
        "name": "(a) simulated dlion MaVo step, N=8, vs 8 timm Lion steps (10M params)",
        "value": ratio, "unit": "x time", "target": "<= 0.7",
        "detail": f"dlion {statistics.median(ours) * 1e3:.0f} ms vs Lion {statistics.median(theirs) * 1e3:.0f} ms "
                  f"(median of {repeats}, interleaved, {torch.get_num_threads()} thread); memory traffic "
                  f"{DLION_BYTES:.0f} vs {8 * LION_BYTES:.0f} B/param, so {DLION_BYTES / (8 * LION_BYTES):.2f}x "
                  f"where both ran at the memory limit; fused kernels {kernels.status('dlion')}",
    }]


def _allocated_per_step(step) -> int:
    """Bytes a step allocates (the profiler's allocations, whatever is freed again within the step included)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())


def _optimizer_rows(numel: int, tensors: int, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    shapes = [numel // tensors] * tensors
    ours_params = [torch.nn.Parameter(torch.randn(n)) for n in shapes]
    theirs_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    for p, q in zip(ours_params, theirs_params, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    ours = DistributedLion(ours_params, lr=1e-4, weight_decay=0.1)
    theirs = Lion(theirs_params, lr=1e-4, weight_decay=0.1)
    loops = max(1, 10_000_000 // numel)  # ~10M parameter-steps per timing: small steps are timed in a loop

    def steps(optimizer):
        return lambda: [optimizer.step() for _ in range(loops)]

    for optimizer in (ours, theirs):
        optimizer.step()  # warm-up: state, flat buffers
    allocated = {name: _allocated_per_step(o.step) for name, o in (("ours", ours), ("theirs", theirs))}
    a, b = [], []
    for _ in range(repeats):
        a += _time(steps(ours), 1)
        b += _time(steps(theirs), 1)
    ours_s, theirs_s = statistics.median(a) / loops, statistics.median(b) / loops
    size = f"{numel / 1e6:g}M" if numel >= 1e6 else f"{numel / 1e3:g}k"
    return [{
        "name": f"(a2) DistributedLion step, world of one, vs timm Lion step ({size} params in {tensors} tensors)",
        "value": ours_s / theirs_s, "unit": "x time", "target": "<= 1.1" if numel >= 1e6 else "<= 1.5",
        "detail": f"{ours_s * 1e3:.3f} ms vs {theirs_s * 1e3:.3f} ms (median of {repeats}, {loops} steps each, "
                  f"interleaved, {torch.get_num_threads()} thread; fused kernels {kernels.status('dlion')})",
    }, {
        "name": f"(a2) bytes allocated per DistributedLion step ({size} params), per parameter",
        "value": allocated["ours"] / numel, "unit": "B/param", "target": "",
        "detail": f"{allocated['ours'] / 1e6:.2f} MB per step, timm Lion {allocated['theirs'] / 1e6:.2f} MB "
                  "(torch.profiler: what one step allocates)",
    }]
