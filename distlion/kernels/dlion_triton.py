"""D-Lion's worker rule and MaVo apply on CUDA as Triton kernels: one pass over memory each.

The same arithmetic as `dlion.c` and as the eager CUDA ops of distlion/methods/dlion.py, which ATen's CUDA
kernels compute with nvcc's default contraction of `a + alpha * b` into one fma:
  update   = fma(g, 1 - b1, m * b1)        torch.mul(m, b1).add_(g, alpha=1 - b1)
  sign bit = update > 0, a tie where update == 0
  m        = fma(w, g - m, m), w = 1 - b2  m.lerp_(g, w), for |w| < 0.5
           = fma(w - 1, g - m, g)          and for |w| >= 0.5
  x        = x * keep -+ lr                x.mul_(1 - lr * wd).add_(+-1, alpha=-lr)
Every fma is written out and the kernels are launched with `enable_fp_fusion=False`, so that Triton's compiler
contracts nothing else (`x * keep + lr` must round twice, as the two eager ops do). `distlion.methods.dlion`
still runs them only after they reproduced the eager ops bit for bit on the device at hand.

Signs are packed little-endian within a byte (element 8k + j is bit j of byte k), as distlion.comm.packing: a
program handles BYTES whole bytes, a [BYTES, 8] tile of elements, and sums each row's distinct powers of two.
"""

from __future__ import annotations

import contextlib
import os
import struct

import torch
import triton
import triton.language as tl

#: Packed bytes per program: 4096 elements, 16 KB of each fp32 operand in flight per program.
BYTES = 512


@triton.jit(do_not_specialize=["tie"])  # one compiled kernel for every tie byte
def _rule_kernel(grad_ptr, momentum_ptr, signs_ptr, n, num_bytes, beta1, one_minus_beta1, weight, tie,
                 SMALL_WEIGHT: tl.constexpr, BYTES: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    index = byte[:, None] * 8 + bit[None, :]
    valid = index < n
    g = tl.load(grad_ptr + index, mask=valid, other=0.0)
    m = tl.load(momentum_ptr + index, mask=valid, other=0.0)
    update = tl.fma(g, one_minus_beta1, m * beta1)
    tie_bit = ((tie >> bit) & 1) != 0
    on = valid & ((update > 0) | ((update == 0) & tie_bit[None, :]))
    packed = tl.sum(tl.where(on, (1 << bit)[None, :], 0), axis=1)  # distinct powers of two: the sum is the OR
    tl.store(signs_ptr + byte, packed.to(tl.uint8), mask=byte < num_bytes)
    if SMALL_WEIGHT:
        m = tl.fma(weight, g - m, m)
    else:
        m = tl.fma(weight - 1.0, g - m, g)
    tl.store(momentum_ptr + index, m, mask=valid)


@triton.jit
def _apply_kernel(x_ptr, vote_ptr, n, num_bytes, keep, lr, BYTES: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    index = byte[:, None] * 8 + bit[None, :]
    valid = index < n
    vote = tl.load(vote_ptr + byte, mask=byte < num_bytes, other=0).to(tl.int32)
    plus = ((vote[:, None] >> bit[None, :]) & 1) != 0
    x = tl.load(x_ptr + index, mask=valid, other=0.0)
    kept = x * keep
    tl.store(x_ptr + index, kept + tl.where(plus, -lr, lr), mask=valid)


def _interpreted() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors, for tests without a GPU; its
    fma rounds twice, so there the bitwise check at load rejects them, as it should."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if tensor.dtype != dtype or tensor.device != device or not tensor.is_contiguous():
        layout = "" if tensor.is_contiguous() else "non-contiguous "
        raise ValueError(f"a CUDA kernel takes contiguous {dtype} tensors on {device}, got a {layout}{tensor.dtype} "
                         f"tensor on {tensor.device}")


def _device(tensor: torch.Tensor) -> torch.device:
    if tensor.device.type != "cuda" and not _interpreted():
        raise ValueError(f"a CUDA kernel takes CUDA tensors, got one on {tensor.device}")
    return tensor.device


def _fp32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Launches on the tensors' GPU, whichever is current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class DLionTritonKernels:
    """The worker rule and MaVo apply of `DLion` on float32 CUDA tensors (the interface of `DLionKernels`)."""

    def __reduce__(self):  # a copied or unpickled method gets this process's kernels, as the CPU ones
        from distlion.kernels import dlion_cuda

        return dlion_cuda, ()

    def rule(self, grad: torch.Tensor, momentum: torch.Tensor, signs: torch.Tensor, betas: tuple[float, float],
             tie: int) -> None:
        """Packs sign(b1 m + (1-b1) g) into `signs` (a tie, an update of exactly 0, takes `tie`'s bit at its
        position in the byte), then m = b2 m + (1-b2) g in place. Returns nothing: counting the ties would
        cost a device sync."""
        device = _device(momentum)
        for tensor, dtype in ((grad, torch.float32), (momentum, torch.float32), (signs, torch.uint8)):
            _check(tensor, dtype, device)
        n = momentum.numel()
        if grad.numel() != n or signs.numel() != (n + 7) // 8:
            raise ValueError(f"{grad.numel()} gradients and {signs.numel()} sign bytes for {n} momenta")
        beta1, beta2 = betas
        weight = 1 - beta2
        # The eager ops take every scalar as fp32 (CUDA's opmath for float), and so does Triton: the same values,
        # and lerp picks its formula by the fp32 weight.
        small = abs(_fp32(weight)) < 0.5
        with _on(device):
            _rule_kernel[(triton.cdiv(signs.numel(), BYTES),)](
                grad, momentum, signs, n, signs.numel(), beta1, 1 - beta1, weight, tie,
                SMALL_WEIGHT=small, BYTES=BYTES, enable_fp_fusion=False)

    def apply(self, x: torch.Tensor, vote: torch.Tensor, lr: float, weight_decay: float) -> None:
        """x = x * (1 - lr wd) - lr * (+1 where the vote's bit is 1, else -1), in place."""
        device = _device(x)
        _check(x, torch.float32, device)
        _check(vote, torch.uint8, device)
        n = x.numel()
        if vote.numel() != (n + 7) // 8:
            raise ValueError(f"{vote.numel()} vote bytes for {n} parameters")
        with _on(device):
            _apply_kernel[(triton.cdiv(vote.numel(), BYTES),)](
                x, vote, n, vote.numel(), 1 - lr * weight_decay, lr, BYTES=BYTES, enable_fp_fusion=False)
