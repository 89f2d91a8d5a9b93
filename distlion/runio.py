"""Run directories: resolved config, config hash, atomic writes, and never losing a finished run.

`RunDir` owns everything a run keeps on disk: the lock that keeps a second process out, the decision
to skip (same config finished) or refuse (another config's results), checkpoints and resuming from
them, the metrics file (truncated to the checkpoint's step on resume) and the summary.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from omegaconf import DictConfig, OmegaConf

# Settings that change where or how a run is reported, not what it computes.
_NOT_HASHED = ("logger", "experiment", "task.name", "train.progress", "train.log_every",
               "train.checkpoint_every", "train.threads")


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


class RunDirConflict(ValueError):
    """The run directory holds results or a checkpoint of another config."""


class RunDir:
    """One run's directory for the config whose hash is `config_hash`.

    Files: config.yaml, metrics.jsonl and summary.json (written by the main process only),
    checkpoint<suffix>.pt (one per process: `suffix` is the backend's `shard_suffix`), .lock<RANK>.
    """

    def __init__(self, path: str | Path, config_hash: str):
        self.path = Path(path)
        self.config_hash = config_hash
        self.metrics_path = self.path / "metrics.jsonl"

    @contextmanager
    def hold(self) -> Iterator[RunDir]:
        """The directory, created and locked for the life of the run."""
        self.path.mkdir(parents=True, exist_ok=True)
        with exclusive_run_dir(self.path):
            yield self

    def finished(self) -> dict[str, Any] | None:
        """The summary of a finished run of this config (to skip it), None if there is none; a finished run
        of another config is refused."""
        summary = read_summary(self.path)
        if summary is not None and summary.get("config_hash") != self.config_hash:
            raise RunDirConflict(
                f"{self.path} holds a finished run of another config (hash {summary.get('config_hash')} != "
                f"{self.config_hash}); choose another experiment= or hydra.run.dir, finished results are never "
                "overwritten"
            )
        return summary

    def checkpoint_path(self, suffix: str) -> Path:
        return self.path / f"checkpoint{suffix}.pt"

    def save_checkpoint(self, suffix: str, state: dict[str, Any]) -> None:
        atomic_torch_save({"config_hash": self.config_hash, **state}, self.checkpoint_path(suffix))

    def load_checkpoint(self, suffix: str) -> dict[str, Any] | None:
        """The checkpoint this process wrote, if any; one of another config is refused."""
        path = self.checkpoint_path(suffix)
        if not path.exists():
            return None
        checkpoint = torch.load(path, weights_only=False)
        if checkpoint["config_hash"] != self.config_hash:
            raise RunDirConflict(
                f"{path} was written by another config (hash {checkpoint['config_hash']} != {self.config_hash}); "
                "rerun with the original settings, or delete the checkpoint to start over"
            )
        return checkpoint

    def open_metrics(self, resumed_step: int) -> IO[str]:
        """metrics.jsonl for appending, without the lines a run resumed at `resumed_step` will write again."""
        if self.metrics_path.exists():
            lines = [line for line in self.metrics_path.read_text().splitlines()
                     if line and json.loads(line)["step"] <= resumed_step]
            atomic_write_text(self.metrics_path, "".join(line + "\n" for line in lines))
        return self.metrics_path.open("a")

    def write_config(self, cfg: DictConfig) -> None:
        atomic_write_text(self.path / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=2))

    def remove_checkpoint(self, suffix: str) -> None:
        """A finished run needs no checkpoint."""
        self.checkpoint_path(suffix).unlink(missing_ok=True)
