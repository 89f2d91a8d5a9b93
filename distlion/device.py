"""Where a run computes: `train.device` and `cluster.dist_backend` (mixed precision: `distlion.amp`).

One place resolves each setting, so the runner, the clusters and torchrun ranks agree:

  train.device        auto (CUDA when available, else the CPU) | cpu | cuda | cuda:K. A torchrun rank with
                      `cuda` or `auto` takes cuda:LOCAL_RANK; a task of a submitit job with GPUs sees only its
                      own GPU (the launcher sets CUDA_VISIBLE_DEVICES per task), which is cuda:0 there.
  cluster.dist_backend  auto (NCCL for CUDA, gloo for the CPU) | gloo | nccl.
"""

from __future__ import annotations

import os

import torch

DEVICES = "auto | cpu | cuda | cuda:K"
DIST_BACKENDS = ("auto", "gloo", "nccl")


def resolve_device(setting: str | None = "auto", local_rank: int | None = None) -> torch.device:
    """The torch device of a `train.device` setting. `auto` and `cuda` on a rank take the rank's own GPU
    (`local_rank`, default the LOCAL_RANK that torchrun sets, modulo the GPUs this process sees)."""
    setting = "auto" if setting is None else str(setting)
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cpu":
        return torch.device("cpu")
    kind, _, index = setting.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"train.device={setting!r} is unknown; choose one of {DEVICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"train.device={setting}: no CUDA device is visible to this process "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use train.device=cpu or auto")
    count = torch.cuda.device_count()
    if index:
        if int(index) >= count:
            raise ValueError(f"train.device={setting}: this process sees {count} CUDA device(s), "
                             f"cuda:0..cuda:{count - 1}")
        return torch.device("cuda", int(index))
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return torch.device("cuda", local_rank % count)


def resolve_dist_backend(setting: str, device: torch.device) -> str:
    """`cluster.dist_backend` for ranks on `device`: auto = NCCL for CUDA, gloo for the CPU."""
    if setting not in DIST_BACKENDS:
        raise ValueError(f"cluster.dist_backend={setting!r} is unknown; choose one of {DIST_BACKENDS}")
    if setting == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if setting == "nccl" and device.type != "cuda":
        raise ValueError("cluster.dist_backend=nccl needs CUDA tensors; use train.device=cuda (or auto on a GPU "
                         "machine), or cluster.dist_backend=gloo")
    return setting


def configure_backends(device: torch.device) -> None:
    """Per-device math settings: TF32 matmuls and convolutions on CUDA (what PyTorch's own recipes use on
    Ampere and later; fp32 master weights and state are unaffected)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.set_device(device)


def describe(device: torch.device) -> str:
    """The device in words, for a run's first line and its summary."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"
