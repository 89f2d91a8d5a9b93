"""Messages: the payloads a method actually builds, so their size is the bits on the wire."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Message:
    """Named tensors sent in one direction by one party in one step.

    `bits` is counted from the tensors themselves (bytes x 8), never from a formula, so the
    accounting cannot drift from what a method really builds.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def bits(self) -> int:
        return sum(t.numel() * t.element_size() * 8 for t in self.tensors.values())

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def meta(self) -> Message:
        """The same message as meta tensors: its size and dtypes (its bits) without its data."""
        return Message({k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in self.tensors.items()})
