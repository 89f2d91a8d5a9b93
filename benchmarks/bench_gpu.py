"""On a CUDA device (rows say "not measured" elsewhere): `DistributedLion` in a world of one against timm's
Lion, and one simulated D-Lion MaVo step of 8 workers against 8 timm Lion steps, 10M parameters, timed with
CUDA synchronization. The checks behind them: `scripts/gpu_check.sh`."""

from __future__ import annotations

import statistics
import time

import torch
from timm.optim import Lion

from distlion import DistributedLion
from distlion.comm.exchange import InProcessExchange
from distlion.methods import StepContext, build_method
from distlion.methods.step import BufferWorkers, algorithm1_step

NUMEL = 10_000_000
WORKERS = 8
REPEATS = 20


def _median_ms(fn) -> float:
    fn()  # warm-up
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run() -> list[dict]:
    if not torch.cuda.is_available():
        return [{"name": "gpu: DistributedLion and D-Lion steps on CUDA", "value": float("nan"), "unit": "x",
                 "target": "", "detail": "not measured: no CUDA device on this machine"}]
    device = torch.device("cuda")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(NUMEL // 20, device=device)) for _ in range(20)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    ours, theirs = DistributedLion(params, lr=1e-4, weight_decay=0.1), Lion(twins, lr=1e-4, weight_decay=0.1)
    ours_ms, theirs_ms = _median_ms(ours.step), _median_ms(theirs.step)

    grads = torch.randn(WORKERS, NUMEL, device=device)
    method = build_method("dlion", lr=1e-4, weight_decay=0.1).bind(torch.randn(NUMEL, device=device), WORKERS)
    local = {grads.dtype: BufferWorkers([method] * WORKERS, [method.init_worker_state() for _ in range(WORKERS)])}
    ctx, exchange = StepContext(step=0, lr=1e-4, num_workers=WORKERS), InProcessExchange(WORKERS)
    lions = [Lion([torch.nn.Parameter(torch.randn(NUMEL, device=device))], lr=1e-4, weight_decay=0.1)
             for _ in range(WORKERS)]
    for opt, g in zip(lions, grads, strict=True):
        opt.param_groups[0]["params"][0].grad = g
    dlion_ms = _median_ms(lambda: algorithm1_step(local, {grads.dtype: grads}, ctx, exchange))
    lion8_ms = _median_ms(lambda: [opt.step() for opt in lions])
    name = torch.cuda.get_device_name()
    return [{
        "name": "gpu: DistributedLion step, world of one, vs timm Lion step (10M params in 20 tensors)",
        "value": ours_ms / theirs_ms, "unit": "x time", "target": "<= 1.1",
        "detail": f"{ours_ms:.2f} ms vs {theirs_ms:.2f} ms on {name} (median of {REPEATS}, synchronized)",
    }, {
        "name": "gpu: simulated dlion MaVo step, N=8, vs 8 timm Lion steps (10M params)",
        "value": dlion_ms / lion8_ms, "unit": "x time", "target": "<= 0.7",
        "detail": f"{dlion_ms:.2f} ms vs {lion8_ms:.2f} ms on {name} (median of {REPEATS}, synchronized)",
    }]
