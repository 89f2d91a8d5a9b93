"""Communication methods by name: `build_method("dlion", lr=1e-4)`, `build_method("dlion_avg")`.

Every module of this package is imported here, so a method file that calls `register(...)` is
available everywhere (runner, config validation, report, README table) without being listed.
"""

from __future__ import annotations

import importlib
import pkgutil

from distlion.methods.base import Method, StepContext
from distlion.methods.registry import (
    FAMILIES,
    METHODS,
    MethodInfo,
    build_method,
    check_hparams,
    hyperparameters,
    label_order,
    method_info,
    method_label,
    method_table,
    register,
    runnable_by,
    variant_of,
)

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "FAMILIES",
    "METHODS",
    "Method",
    "MethodInfo",
    "StepContext",
    "build_method",
    "check_hparams",
    "hyperparameters",
    "label_order",
    "method_info",
    "method_label",
    "method_table",
    "register",
    "runnable_by",
    "variant_of",
]
