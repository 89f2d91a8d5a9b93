"""Run directories: resolved config, config hash, atomic writes, and never losing a finished run."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

# Settings that change where or how a run is reported, not what it computes.
_NOT_HASHED = ("logger", "experiment", "train.progress", "train.log_every", "train.checkpoint_every", "train.threads")


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)


def config_hash(cfg: DictConfig) -> str:
    """A hash of everything that determines the run's numbers."""
    config = resolved_config(cfg)
    for dotted in _NOT_HASHED:
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


@contextmanager
def exclusive_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock (one per torchrun rank) so that two processes never write one run.

    An flock is released by the kernel when its process dies, so a killed run never leaves it behind.
    """
    with (run_dir / f".lock{os.environ.get('RANK', '')}").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusy(
                f"{run_dir} is being written by another process (a second copy of this run or sweep?); "
                "wait for it to finish or stop it, then rerun"
            ) from None
        yield


class RunDirBusy(ValueError):
    """Another live process holds the run directory."""


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def git_version() -> dict[str, Any]:
    """Commit and dirty flag of the code that produced a result (None outside a git checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True)
        return {"git_sha": sha.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.CalledProcessError):
        return {"git_sha": None, "git_dirty": None}


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None
