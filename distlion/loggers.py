"""Where metrics go besides metrics.jsonl: wandb (offline unless the user logs in) or nowhere."""

from __future__ import annotations

import os
from typing import Any


class NullLogger:
    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger:
    """wandb run grouped by experiment; eval metrics plotted against cumulative bits per parameter."""

    def __init__(self, project: str, group: str, name: str, config: dict, run_dir: str, mode: str = "offline",
                 tags: list[str] | None = None):
        import wandb  # imported lazily: `logger=none` runs never touch it

        os.environ.setdefault("WANDB_SILENT", "true")
        self._wandb = wandb
        self.run = wandb.init(project=project, group=group, name=name, config=config, dir=run_dir, mode=mode,
                              tags=tags, reinit="finish_previous")
        self.run.define_metric("step")
        self.run.define_metric("train/*", step_metric="step")
        self.run.define_metric("comm/cum_bits_per_param")
        for section in ("val/*", "test/*"):  # evaluations against communicated bits, the paper's x-axis
            self.run.define_metric(section, step_metric="comm/cum_bits_per_param")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        import wandb

        # A list is an already binned histogram of the values 0, 1/N, ..., 1 (vote_margins: |sum of signs| / N).
        def value(v: Any) -> Any:
            if not isinstance(v, list):
                return v
            n = max(1, len(v) - 1)
            return wandb.Histogram(np_histogram=(v, [(i - 0.5) / n for i in range(len(v) + 1)]))

        self.run.log({_wandb_key(k): value(v) for k, v in metrics.items() if v is not None})

    def finish(self) -> None:
        self.run.finish()


def _wandb_key(key: str) -> str:
    for prefix, section in (("val_", "val/"), ("test_", "test/")):
        if key.startswith(prefix):
            return section + key[len(prefix):]
    if key in ("step", "epoch", "wall_time"):
        return key
    if "bits" in key:
        return "comm/" + key
    return "train/" + key


def build_logger(cfg: Any, config: dict, run_dir: str, group: str, name: str, tags: list[str]):
    if cfg.name == "none":
        return NullLogger()
    if cfg.name == "wandb":
        return WandbLogger(cfg.project, group, name, config, run_dir, cfg.mode, tags)
    raise ValueError(f"logger={cfg.name!r} is unknown; choose 'wandb' or 'none'")
