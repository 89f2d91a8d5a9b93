"""A check that code forgets no device: inside `DeviceExplicit`, a tensor factory (torch.zeros, torch.tensor,
torch.arange, ...) called from distlion's own code without an explicit `device=` raises. On a GPU such a call makes a
CPU tensor next to CUDA ones: a crash, or a silent copy every step. `*_like` and `Tensor.new_*` calls inherit their
device and are not factories here; tensors made on purpose on the CPU (the data pipeline, generators' draws) say
`device="cpu"`.

torch routes factories through torch-function modes (`torch.device` as a context manager is one), so the mode sees
every call, and the caller's frame tells whether distlion made it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

PACKAGE = str(Path(__file__).resolve().parent.parent / "distlion") + "/"
TORCH = str(Path(torch.__file__).resolve().parent) + "/"


class DeviceForgotten(AssertionError):
    """A factory call in distlion without an explicit device."""


class DeviceExplicit(TorchFunctionMode):
    """Raise `DeviceForgotten` at any factory call made by distlion's code without `device=`."""

    def __init__(self) -> None:
        super().__init__()
        self.factories = _device_constructors()
        self.checked = 0  # factory calls by distlion seen (a guard that sees none checks nothing)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories:
            caller = _caller()
            if caller is not None:
                self.checked += 1
                if kwargs.get("device") is None:
                    raise DeviceForgotten(f"{caller}: {func.__name__}(...) without device=")
        return func(*args, **kwargs)


def _caller() -> str | None:
    """'file:line' of the first frame outside torch and this module, if it is distlion's."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(PACKAGE):
        return None
    return f"{frame.f_code.co_filename[len(PACKAGE) - len('distlion/'):]}:{frame.f_lineno}"
