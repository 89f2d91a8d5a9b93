"""Fused kernels: in C for the CPU, built on first use with the system's C compiler and called through ctypes, and
in Triton for CUDA (`dlion_triton.py`, compiled by Triton on first launch).

They are an optimization only, never a different result: `distlion.methods.dlion` runs a kernel only after it
reproduced the eager torch ops bit for bit on this machine (on CUDA: on that device), and otherwise (no compiler,
no Triton, a failed build, another rounding, `DISTLION_KERNELS=0`) keeps the eager ops; `status("dlion")` and
`status("dlion_cuda")` say which and why. The C build is a single `cc` call of well under a second, cached under
`~/.cache/distlion/kernels` (or `$DISTLION_CACHE`) per source, flags and CPU, since `-march=native` code must not
move to another CPU model on a shared home directory.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-pthread")
_reasons: dict[str, str] = {}


def cache_dir() -> Path:
    root = os.environ.get("DISTLION_CACHE") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "distlion" / "kernels"


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keys = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(keys)}))


def _build(name: str, compiler: str) -> Path:
    source = SOURCES / f"{name}.c"
    key = hashlib.sha256(b"\0".join(
        [source.read_bytes(), " ".join((compiler, *FLAGS)).encode(), _cpu_identity().encode()])).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed onto it: ranks and sweep jobs that build at once never load half a file.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run([compiler, *FLAGS, "-o", str(partial), str(source), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


@functools.cache
def library(name: str) -> ctypes.CDLL | None:
    """The kernel library `name` (`distlion/kernels/<name>.c`), built if needed; None where it cannot be."""
    if os.environ.get("DISTLION_KERNELS", "1") == "0":
        _reasons[name] = "off: DISTLION_KERNELS=0"
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        _reasons[name] = "off: no C compiler (set CC, or install cc); the eager torch ops run"
        return None
    try:
        lib = ctypes.CDLL(str(_build(name, compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        _reasons[name] = f"off: the build failed ({detail.strip().splitlines()[-1] if detail.strip() else error})"
        return None
    _reasons[name] = "on"
    return lib


def status(name: str) -> str:
    """'on', or 'off: <why>' (after the first `library(name)` call or a failed check)."""
    return _reasons.get(name, "not loaded")


def disable(name: str, why: str) -> None:
    """Record that a built kernel was not used (e.g. it did not reproduce the eager ops here)."""
    _reasons[name] = f"off: {why}"


def _pointer(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"a CPU kernel takes contiguous {dtype} CPU tensors, got {tensor.dtype} on {tensor.device}")
    return tensor.data_ptr()


class DLionKernels:
    """`dlion.c`'s worker rule and MaVo apply on float32 CPU tensors, on torch's intra-op thread count."""

    def __init__(self, lib: ctypes.CDLL):
        self._rule, self._apply = lib.dlion_rule, lib.dlion_apply
        pointer, size, single = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._rule.argtypes = [pointer, pointer, pointer, size, single, single, single, ctypes.c_uint, ctypes.c_int]
        self._rule.restype = ctypes.c_int64
        self._apply.argtypes = [pointer, pointer, size, single, single, ctypes.c_int]
        self._apply.restype = None

    def __reduce__(self):  # a copied or unpickled method gets this process's kernels (ctypes pointers don't copy)
        return dlion, ()

    def rule(self, grad: torch.Tensor, momentum: torch.Tensor, signs: torch.Tensor, betas: tuple[float, float],
             tie: int) -> int:
        """Packs sign(b1 m + (1-b1) g) into `signs` (a tie, an update of exactly 0, takes `tie`'s bit at its
        position in the byte), then m = b2 m + (1-b2) g in place. Returns the number of ties."""
        n = momentum.numel()
        if grad.numel() != n or signs.numel() != (n + 7) // 8:
            raise ValueError(f"{grad.numel()} gradients and {signs.numel()} sign bytes for {n} momenta")
        beta1, beta2 = betas
        return self._rule(_pointer(grad, torch.float32), _pointer(momentum, torch.float32),
                          _pointer(signs, torch.uint8), n, beta1, 1 - beta1, 1 - beta2, tie, torch.get_num_threads())

    def apply(self, x: torch.Tensor, vote: torch.Tensor, lr: float, weight_decay: float) -> None:
        """x = x * (1 - lr wd) - lr * (+1 where the vote's bit is 1, else -1), in place."""
        n = x.numel()
        if vote.numel() != (n + 7) // 8:
            raise ValueError(f"{vote.numel()} vote bytes for {n} parameters")
        self._apply(_pointer(x, torch.float32), _pointer(vote, torch.uint8), n, 1 - lr * weight_decay, lr,
                    torch.get_num_threads())


@functools.cache
def dlion() -> DLionKernels | None:
    lib = library("dlion")
    return None if lib is None else DLionKernels(lib)


@functools.cache
def dlion_cuda():
    """The Triton kernels of D-Lion's worker rule and MaVo apply on CUDA (`dlion_triton.DLionTritonKernels`), or None
    where Triton cannot be imported; `status("dlion_cuda")` says which. Whether they reproduce the eager ops is
    checked per device by `distlion.methods.dlion.checked_cuda_kernels`."""
    if os.environ.get("DISTLION_KERNELS", "1") == "0":
        _reasons["dlion_cuda"] = "off: DISTLION_KERNELS=0"
        return None
    try:
        from distlion.kernels.dlion_triton import DLionTritonKernels
    except ImportError as error:  # a CPU-only torch build, or triton missing
        _reasons["dlion_cuda"] = f"off: Triton cannot be imported ({error}); the eager ops run"
        return None
    _reasons["dlion_cuda"] = "on"
    return DLionTritonKernels()
