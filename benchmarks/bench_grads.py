"""(d) Per-worker gradients of N=8 workers x 32 images against one backward over 256 images.

A small CIFAR-shaped timm ViT (32x32x3 images, 4x4 patches, width 128, depth 4, 4 heads, ~0.8M
parameters, 65 tokens). Each strategy computes the 8 workers' gradients at the same parameters;
its time is divided by that of one worker's forward and backward over the whole global batch of
256, measured in the same round just before it; the row gives the median over rounds.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from distlion.cluster.grads import STRATEGIES
from distlion.flat import FlatParams

WORKERS = 8
PER_WORKER = 32
BATCH = WORKERS * PER_WORKER
TARGETS = {"batched": "<= 1.25"}


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def run(repeats: int = 3) -> list[dict]:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=128, depth=4,
                              num_heads=4, mlp_ratio=4.0)
    model.train()
    flat = FlatParams(model)
    inputs = torch.randn(BATCH, 3, 32, 32)
    targets = torch.randint(0, 10, (BATCH,))

    def job(strategy: str, workers: int, rows: int = BATCH):
        return lambda: STRATEGIES[strategy](model, flat, _loss, inputs[:rows], targets[:rows], workers)

    # Batched, the target row, runs right after the baseline it is divided by.
    order = sorted(STRATEGIES, key=lambda name: name != "batched")
    jobs = {"single": job("sequential", 1), **{name: job(name, WORKERS) for name in order}}
    times: dict[str, list[float]] = {name: [] for name in jobs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's "no batching rule for attention" performance notice
        for name in STRATEGIES:  # warm-up on a small batch
            job(name, WORKERS, rows=2 * WORKERS)()
        for _ in range(repeats):  # interleaved, so a busy spell on a shared machine hits all alike
            for name, fn in jobs.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    rows = []
    for name in STRATEGIES:
        # Each round's ratio pairs two runs seconds apart, so slow drifts of the machine's load cancel.
        ratios = [t / base for t, base in zip(times[name], times["single"], strict=True)]
        rows.append({
            "name": f"(d) per-worker grads, {name}, {WORKERS}x{PER_WORKER} vs 1x{BATCH} images (ViT)",
            "value": statistics.median(ratios),
            "unit": "x time",
            "target": TARGETS.get(name, ""),
            "detail": f"median of {repeats} interleaved rounds (range {min(ratios):.2f}-{max(ratios):.2f}); "
                      f"{statistics.median(times[name]) * 1e3:.0f} ms vs "
                      f"{statistics.median(times['single']) * 1e3:.0f} ms; {flat.numel / 1e6:.2f}M params",
        })
    return rows


if __name__ == "__main__":
    for row in run():
        print(f"{row['name']}: {row['value']:.3g} {row['unit']} (target {row['target']}); {row['detail']}")
