"""(data) CIFAR-10 loader throughput against training throughput of vit_cifar_cpu, same process.

The loader is `Cifar10Task.train_batch` on random indices (random crop with padding 4, flip and
normalization on the uint8 tensor cache); training is one forward + backward of `vit_cifar_cpu` at
the same batch of 128. The loader must be far faster than training for data not to be the
bottleneck on 2 cores. Also: seconds to load the decoded tensor cache (decoded once on first use).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from distlion.tasks.cifar10 import Cifar10Task
from distlion.tasks.data import data_root

BATCH = 128
MODEL = Path(__file__).resolve().parent.parent / "conf" / "model" / "vit_cifar_cpu.yaml"
TARGETS = {"ratio": ">= 10", "cache": "< 1"}


def run(repeats: int = 5) -> list[dict]:
    if data_root() is None or not (data_root() / "cifar10").is_dir():
        print("  skipped: no CIFAR-10 under $DISTLION_DATA")
        return []
    model_cfg = OmegaConf.load(MODEL)
    Cifar10Task(model_cfg)  # builds the decoded cache if this is the first use
    start = time.perf_counter()
    task = Cifar10Task(model_cfg)
    cache_seconds = time.perf_counter() - start

    torch.manual_seed(0)
    model = hydra.utils.instantiate(model_cfg)
    model.train()
    generator = torch.Generator().manual_seed(0)
    x, y = task.train_batch(torch.randint(0, task.num_train, (BATCH,), generator=generator), generator)
    F.cross_entropy(model(x), y).backward()  # warm-up

    load, train = [], []
    for _ in range(repeats):  # interleaved, so a busy spell on a shared machine hits both alike
        start = time.perf_counter()
        x, y = task.train_batch(torch.randint(0, task.num_train, (BATCH,), generator=generator), generator)
        load.append(BATCH / (time.perf_counter() - start))
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        train.append(BATCH / (time.perf_counter() - start))
    load_rate, train_rate = statistics.median(load), statistics.median(train)
    detail = f"batch {BATCH}, median of {repeats}, {torch.get_num_threads()} threads"
    return [
        {"name": "(data) CIFAR-10 loader, crop+flip+normalize", "value": load_rate, "unit": "images/s",
         "target": "", "detail": detail},
        {"name": "(data) vit_cifar_cpu forward+backward", "value": train_rate, "unit": "images/s",
         "target": "", "detail": detail},
        {"name": "(data) loader / training throughput", "value": load_rate / train_rate, "unit": "x",
         "target": TARGETS["ratio"], "detail": detail},
        {"name": "(data) load the decoded CIFAR-10 cache (60,000 uint8 images)", "value": cache_seconds,
         "unit": "s", "target": TARGETS["cache"],
         "detail": "torch.load(mmap=True) of the 150 MB train + 30 MB test cache"},
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
