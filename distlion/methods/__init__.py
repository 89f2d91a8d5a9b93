"""Communication methods by name: `build_method("dlion", lr=1e-4, aggregation="mavo")`."""

from __future__ import annotations

from typing import Any

from distlion.methods.base import Method, StepContext
from distlion.methods.dgc import DGC
from distlion.methods.dlion import DLion
from distlion.methods.global_opt import GlobalAdamW, GlobalLion
from distlion.methods.graddrop import GradDrop
from distlion.methods.terngrad import TernGrad

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (DLion, GlobalLion, GlobalAdamW, DGC, TernGrad, GradDrop)
}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


def build_method(name: str, **hparams: Any) -> Method:
    """Build an (unbound) method by its registry name with its hyperparameters."""
    if name not in METHODS:
        raise ValueError(f"method={name!r} is unknown; choose one of {sorted(METHODS)}")
    return METHODS[name](**hparams)


__all__ = ["METHODS", "Method", "StepContext", "build_method", "register"]
