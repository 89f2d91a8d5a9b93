"""On a CUDA device (elsewhere one row says "not measured"), timed with CUDA synchronization, each ratio's two sides
interleaved repetition by repetition:

- `DistributedLion` in a world of one against timm's Lion (foreach), 100M parameters in 20 tensors;
- one simulated D-Lion MaVo step of 8 workers (worker rules, vote, apply) against 8 timm Lion steps, 100M parameters;
- images/s of `vit_cifar_paper` forward+backward, fp32 (TF32 matmuls, as `train.device=cuda` runs) and bf16 autocast;
- the CUDA memory per simulated worker of `vit_cifar_paper` under D-Lion MaVo: the peak of a training step (gradients
  and cluster step) with N and 2N workers, their difference / N.

`scripts/gpu_check.sh` writes these rows into results/gpu/README.md; `make bench` into results/bench.md."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.optim import Lion

from distlion import DistributedLion, kernels
from distlion.comm.exchange import InProcessExchange
from distlion.device import configure_backends
from distlion.methods import StepContext, build_method
from distlion.methods.step import BufferWorkers, algorithm1_step

NUMEL = 100_000_000
TENSORS = 20
WORKERS = 8
REPEATS = 20
MODEL = Path(__file__).resolve().parent.parent / "conf" / "model" / "vit_cifar_paper.yaml"
IMAGES = 256  # per forward+backward
MEMORY_WORKERS = 4  # N; the memory row compares N and 2N workers
PER_WORKER_BATCH = 32


def _sync_ms(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def _paired_ms(a: Callable[[], object], b: Callable[[], object], repeats: int = REPEATS) -> tuple[float, float]:
    """Medians of a and b, alternated repetition by repetition so both see the same clocks and neighbours."""
    a(), b()  # warm-up: Triton and cuBLAS pick and compile their kernels on first use
    times = [(_sync_ms(a), _sync_ms(b)) for _ in range(repeats)]
    return statistics.median(t for t, _ in times), statistics.median(t for _, t in times)


def run() -> list[dict]:
    if not torch.cuda.is_available():
        return [{"name": "gpu: DistributedLion, D-Lion step, vit_cifar_paper throughput and memory on CUDA",
                 "value": float("nan"), "unit": "", "target": "", "detail": "not measured: no CUDA device here"}]
    device = torch.device("cuda", torch.cuda.current_device())
    configure_backends(device)
    name = torch.cuda.get_device_name(device)
    rows = [*_optimizer_rows(device), *_model_rows(device)]
    for row in rows:
        row["detail"] += f" on {name}"
    return rows


def _optimizer_rows(device: torch.device) -> list[dict]:
    ours_ms, theirs_ms = _world_of_one_ms(device)
    torch.cuda.empty_cache()  # (each measurement's tensors are freed when its function returns)
    dlion_ms, lion8_ms = _simulated_step_ms(device)
    torch.cuda.empty_cache()
    fused = kernels.status("dlion_cuda")
    return [{
        "name": f"gpu: DistributedLion step, world of one, vs timm Lion (foreach) step ({NUMEL // 10**6}M params in "
                f"{TENSORS} tensors)",
        "value": ours_ms / theirs_ms, "unit": "x time", "target": "<= 1.1",
        "detail": f"{ours_ms:.2f} ms vs {theirs_ms:.2f} ms (median of {REPEATS}, synchronized; fused kernels: {fused})",
    }, {
        "name": f"gpu: simulated dlion MaVo step, N={WORKERS}, vs {WORKERS} timm Lion (foreach) steps "
                f"({NUMEL // 10**6}M params)",
        "value": dlion_ms / lion8_ms, "unit": "x time", "target": "<= 0.7",
        "detail": f"{dlion_ms:.2f} ms vs {lion8_ms:.2f} ms (median of {REPEATS}, synchronized; fused kernels: {fused})",
    }]


def _world_of_one_ms(device: torch.device) -> tuple[float, float]:
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(NUMEL // TENSORS, generator=gen, device=device)) for _ in range(TENSORS)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn(p.shape, generator=gen, device=device)
        q.grad = p.grad.clone()
    ours = DistributedLion(params, lr=1e-4, weight_decay=0.1)
    theirs = Lion(twins, lr=1e-4, weight_decay=0.1, foreach=True)
    return _paired_ms(ours.step, theirs.step)


def _simulated_step_ms(device: torch.device) -> tuple[float, float]:
    gen = torch.Generator(device=device).manual_seed(1)
    grads = torch.randn(WORKERS, NUMEL, generator=gen, device=device)
    method = build_method("dlion", lr=1e-4, weight_decay=0.1).bind(torch.randn(NUMEL, generator=gen, device=device),
                                                                   WORKERS)
    local = {grads.dtype: BufferWorkers([method] * WORKERS, [method.init_worker_state() for _ in range(WORKERS)])}
    ctx, exchange = StepContext(step=0, lr=1e-4, num_workers=WORKERS), InProcessExchange(WORKERS)
    lions = [Lion([torch.nn.Parameter(torch.randn(NUMEL, generator=gen, device=device))], lr=1e-4, weight_decay=0.1,
                  foreach=True) for _ in range(WORKERS)]
    for opt, g in zip(lions, grads, strict=True):
        opt.param_groups[0]["params"][0].grad = g
    return _paired_ms(lambda: algorithm1_step(local, {grads.dtype: grads}, ctx, exchange),
                      lambda: [opt.step() for opt in lions])


def vit_cifar_paper(device: torch.device) -> torch.nn.Module:
    """The paper-scale CIFAR ViT of conf/model/vit_cifar_paper.yaml (no data set needed)."""
    import hydra
    from omegaconf import OmegaConf

    torch.manual_seed(0)
    return hydra.utils.instantiate(OmegaConf.load(MODEL)).to(device)


def _model_rows(device: torch.device) -> list[dict]:
    model = vit_cifar_paper(device)
    numel = sum(p.numel() for p in model.parameters())
    fp32_ms, bf16_ms = _throughput_ms(model, device)
    per_worker = _memory_per_worker(model, device)
    rows = [{
        "name": f"gpu: vit_cifar_paper forward+backward, {precision}",
        "value": IMAGES / (ms / 1e3), "unit": "images/s", "target": "",
        "detail": f"{ms:.2f} ms per batch of {IMAGES} 32x32 images, {numel / 1e6:.2f}M params (median of {REPEATS})",
    } for precision, ms in (("fp32 (TF32 matmuls)", fp32_ms), ("bf16 autocast", bf16_ms))]
    n = MEMORY_WORKERS
    return [*rows, {
        "name": "gpu: CUDA memory per simulated worker, vit_cifar_paper, dlion MaVo",
        "value": per_worker / 2**20, "unit": "MiB", "target": "",
        "detail": f"(peak at N={2 * n} - peak at N={n}) / {n}, {PER_WORKER_BATCH} images per worker, grad_strategy="
                  f"batched: {per_worker / numel:.1f} bytes per parameter ({numel / 1e6:.2f}M params)",
    }]


def _throughput_ms(model: torch.nn.Module, device: torch.device) -> tuple[float, float]:
    """ms per forward+backward of IMAGES images, fp32 and under bf16 autocast."""
    gen = torch.Generator(device=device).manual_seed(0)
    images = torch.randn(IMAGES, 3, 32, 32, generator=gen, device=device)
    labels = torch.randint(0, 10, (IMAGES,), generator=gen, device=device)

    def forward_backward(dtype: torch.dtype | None) -> Callable[[], None]:
        def step() -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            model.zero_grad(set_to_none=True)

        return step

    return _paired_ms(forward_backward(None), forward_backward(torch.bfloat16))


def _memory_per_worker(model: torch.nn.Module, device: torch.device) -> float:
    """Bytes that one more simulated worker costs at the peak of a training step."""
    from distlion.cluster.simulated import SimulatedCluster
    from distlion.flat import FlatParams

    flat = FlatParams(model)

    def loss(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(module(x), y, reduction="none")

    def peak(workers: int) -> int:
        cluster = SimulatedCluster(build_method("dlion", lr=1e-4), flat, workers)
        compute = cluster.gradients(model, "batched")
        gen = torch.Generator(device=device).manual_seed(workers)
        batch = workers * PER_WORKER_BATCH
        x = torch.randn(batch, 3, 32, 32, generator=gen, device=device)
        y = torch.randint(0, 10, (batch,), generator=gen, device=device)
        for step in range(2):  # the peak of the second step, which holds the states and scratch the first made
            if step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            grads, _ = compute(model, flat, loss, x, y, workers)
            cluster.step(grads, step=step, lr=1e-4)
            del grads
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device)

    small = peak(MEMORY_WORKERS)
    torch.cuda.empty_cache()  # the first cluster's states and scratch went with `peak`'s frame
    large = peak(2 * MEMORY_WORKERS)
    return (large - small) / MEMORY_WORKERS
