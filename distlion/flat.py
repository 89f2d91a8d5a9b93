"""Model parameters as one contiguous buffer per dtype.

Every method works on flat 1-D buffers: packing 8 signs per byte then wastes at most 7 bits per
buffer and step, and a step's exchange is one message instead of one per tensor. The model's
parameters become views into the buffer, so updating the buffer updates the model in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Segment:
    """One parameter tensor's place inside a flat buffer."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.offset + self.numel

    @property
    def is_matrix(self) -> bool:
        """True for weights of dim > 1 (DGC compresses only these; biases and norms go dense)."""
        return len(self.shape) > 1


Layout = list[Segment]

#: Parameter dtypes whose rounding step near 1 (2^-8 for bf16) swallows small updates.
LOW_PRECISION = (torch.bfloat16, torch.float16)


class FlatParams:
    """Re-homes a module's trainable parameters into one flat buffer per dtype.

    `buffers[dtype]` is the 1-D tensor that holds them; `layouts[dtype]` says where each one sits.
    """

    def __init__(self, module: nn.Module):
        params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        self.dtypes: list[torch.dtype] = sorted({p.dtype for _, p in params}, key=str)
        self.params: dict[torch.dtype, list[nn.Parameter]] = {d: [] for d in self.dtypes}
        self.layouts: dict[torch.dtype, Layout] = {d: [] for d in self.dtypes}
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        for dtype in self.dtypes:
            group = [(name, p) for name, p in params if p.dtype == dtype]
            total = sum(p.numel() for _, p in group)
            buffer = torch.empty(total, dtype=dtype, device=group[0][1].device)
            offset = 0
            for name, p in group:
                n = p.numel()
                buffer[offset : offset + n].copy_(p.detach().reshape(-1))
                p.data = buffer[offset : offset + n].view_as(p)
                self.params[dtype].append(p)
                self.layouts[dtype].append(Segment(name, offset, n, tuple(p.shape)))
                offset += n
            self.buffers[dtype] = buffer

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.buffers.values())).device
