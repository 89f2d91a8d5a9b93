"""The method registry: what each method is, declared in its own file, read by everyone else.

In the spirit of timm's `OptimInfo`: a method file ends with `register(MethodInfo(...))` for each
variant it offers (a variant is a class plus fixed settings: `dlion_avg` is `DLion` with
`aggregation="avg"`). The runner builds methods from it, the config validation checks settings
against it, the report takes labels and order from it, and the README's method table is rendered
from it (`python -m distlion.methods`).

Bit formulas are Python expressions, in bits per parameter per step, of:
  n  parameters of the flat buffer      N  workers          L  parameter tensors (layers)
  k  entries a worker sends (sparse)    U  the union of the workers' sent indices
  n_dense  entries a sparse or low-rank method always sends dense (DGC's biases and norms; PowerSGD's vectors
           and matrices too small to compress)
  pq  PowerSGD's low-rank factors: the sum over compressed matrices of (rows + cols) x rank
  z   1 for D-Lion with zero_sign="zero" (ternary messages), else 0
They are nominal: packing pads each bit-plane to whole bytes (at most 7 bits per plane and step).
The tests evaluate them against the bits of the messages actually built.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from distlion.methods.base import Method

FAMILIES = ("global", "quantized", "sparse", "sign", "local")
FORMULA_NAMES = {"ceil": math.ceil, "log2": math.log2, "min": min, "max": max}


@dataclass(frozen=True)
class MethodInfo:
    """One registered method variant."""

    name: str
    """Config name: `method=<name>` (the file conf/method/<name>.yaml)."""
    cls: type[Method]
    label: str
    """The paper's name, used in tables and plots."""
    family: str
    """global (fp32 mean gradient) | quantized | sparse | sign | local (local updates, a sync every H steps)."""
    bits_up: str
    """Worker -> server bits per parameter per step (see the module docstring for the symbols)."""
    bits_down: str
    """Server -> worker bits per parameter per step."""
    summary: str
    """One line: what it computes, for the README's method table."""
    order: int
    """Position in tables and legends (the paper's order: global methods first, D-Lion last)."""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Settings that make this variant (e.g. aggregation="avg")."""
    reference: str = ""
    """Paper or code it follows."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"method {self.name!r}: family {self.family!r} is not one of {FAMILIES}")
        unknown = set(self.fixed) - set(hyperparameters(self.cls))
        if unknown:
            raise ValueError(f"method {self.name!r}: fixed settings {sorted(unknown)} are not hyperparameters")

    def bits(self, **symbols: float) -> tuple[float, float]:
        """(up, down) bits per parameter per step from the formulas, given the symbols they use."""
        scope = {**FORMULA_NAMES, **symbols}
        return eval(self.bits_up, {"__builtins__": {}}, scope), eval(self.bits_down, {"__builtins__": {}}, scope)

    def defaults(self) -> dict[str, Any]:
        """Every hyperparameter with its default, this variant's fixed settings applied."""
        return {**hyperparameters(self.cls), **self.fixed}


METHODS: dict[str, MethodInfo] = {}


def register(info: MethodInfo) -> MethodInfo:
    if info.name in METHODS and METHODS[info.name] != info:
        raise ValueError(f"method {info.name!r} is registered twice")
    METHODS[info.name] = info
    return info


def hyperparameters(cls: type[Method]) -> dict[str, Any]:
    """A method's hyperparameters are its constructor's arguments, with their defaults."""
    params = inspect.signature(cls.__init__).parameters
    return {k: p.default for k, p in params.items() if k != "self"}


def runnable_by(backend: str) -> list[str]:
    """The registered methods a cluster backend can run ("simulated": all but those exchanging in backward)."""
    return sorted(name for name, info in METHODS.items() if backend in info.cls.backends)


def method_info(name: str) -> MethodInfo:
    if name not in METHODS:
        raise ValueError(f"method={name!r} is unknown; choose one of {sorted(METHODS)}")
    return METHODS[name]


def check_hparams(name: str, hparams: Mapping[str, Any]) -> None:
    """Unknown settings of a method, named with the nearest valid one."""
    valid = hyperparameters(method_info(name).cls)
    for key in hparams:
        if key not in valid:
            near = difflib.get_close_matches(key, list(valid), n=1)
            hint = f"did you mean method.{near[0]}? " if near else ""
            raise ValueError(f"method.{key} is not a setting of method={name}; {hint}valid: {sorted(valid)}")


def build_method(name: str, **hparams: Any) -> Method:
    """Build an (unbound) method by its config name with its hyperparameters."""
    info = method_info(name)
    check_hparams(name, hparams)
    return info.cls(**{**info.fixed, **hparams})


def variant_of(name: str, hparams: Mapping[str, Any]) -> MethodInfo:
    """The registered variant a run of method `name` (its registered config name, as summaries record it, or its
    class name, as they did before one name per method) with these settings is: the variant of that class these
    settings make (most fixed settings matched first; a setting the run does not record counts as its default)."""
    name = METHODS[name].cls.name if name in METHODS else name
    candidates = [i for i in METHODS.values() if i.cls.name == name]
    if not candidates:
        raise ValueError(f"no registered method has class name {name!r}")
    defaults = hyperparameters(candidates[0].cls)  # the class's own, not a variant's fixed ones
    matching = [i for i in candidates if all(hparams.get(k, defaults[k]) == v for k, v in i.fixed.items())]
    return max(matching or candidates, key=lambda i: len(i.fixed))


def method_label(name: str, hparams: Mapping[str, Any]) -> str:
    """The paper's name of a run's method: `method_label("dlion", {"aggregation": "avg"})` is "D-Lion (Avg)"."""
    return variant_of(name, hparams).label


def label_order(label: str) -> int:
    """Sort key of a label in tables and legends; labels of no registered method go last."""
    return next((i.order for i in METHODS.values() if i.label == label), len(METHODS) + 1000)


def _formula(expression: str) -> str:
    return expression.replace("*", " ")


def method_table() -> str:
    """The README's method table, rendered from the registry."""
    lines = ["| method | `method=` | family | worker -> server | server -> worker |", "|---|---|---|---|---|"]
    for info in sorted(METHODS.values(), key=lambda i: i.order):
        lines.append(f"| {info.label}: {info.summary} | `{info.name}` | {info.family} "
                     f"| {_formula(info.bits_up)} | {_formula(info.bits_down)} |")
    return "\n".join(lines) + "\n"
