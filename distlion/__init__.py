"""distlion: a benchmarking harness for communication-efficient distributed training.

Built around Distributed Lion (Liu et al. 2024, arXiv 2404.00438).
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use (PEP 562), so that tools needing no torch (distlion-netem) start at once.
_EXPORTS = {"Simulation": "distlion.api", "StepResult": "distlion.api", "METHODS": "distlion.methods",
            "Method": "distlion.methods", "StepContext": "distlion.methods", "build_method": "distlion.methods",
            "DistributedLion": "distlion.optim"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'distlion' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
