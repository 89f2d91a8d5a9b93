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
