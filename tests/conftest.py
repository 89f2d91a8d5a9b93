from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

CONF = str(Path(__file__).resolve().parent.parent / "conf")


@pytest.fixture
def make_cfg():
    """Compose the Hydra config with overrides, as the CLI would (no wandb, no progress bar)."""

    def _make(*overrides: str):
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            return compose("config", overrides=["logger=none", "train.progress=false", *overrides])

    return _make


class Crash(Exception):
    """The process dying right after a checkpoint."""


@pytest.fixture
def crash_after_checkpoint(monkeypatch):
    """`crash(cfg, run_dir, step)`: train `cfg` into `run_dir` until its checkpoint at `step` is written, then die
    there (as a killed process would), leaving a run to resume."""
    from distlion.runio import RunDir
    from distlion.train import run

    def crash(cfg, run_dir: Path, step: int) -> None:
        save = RunDir.save_checkpoint

        def save_then_crash(directory, suffix, state):
            save(directory, suffix, state)
            if state["step"] == step:
                raise Crash

        with monkeypatch.context() as patch:
            patch.setattr(RunDir, "save_checkpoint", save_then_crash)
            with pytest.raises(Crash):
                run(cfg, run_dir)

    return crash
