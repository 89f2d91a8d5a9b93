"""Mixed precision as users run it (`train.amp`): the forward, and so the backward it records, under autocast,
while parameters, gradients and every method's state stay fp32.

fp16 needs a loss scale: gradients below fp16's smallest normal number would flush to zero. `LossScale` is
torch's `GradScaler` rule (start at 2^16, halve on an overflow and skip the step, double after 2000 clean steps),
applied to the step's *agreed* skip decision rather than to one process's own: under torchrun one rank's overflow
skips the step on every rank (`algorithm1_step`'s agreement), so every rank's scale must move alike, and
`GradScaler` decides per process. Its scales are powers of two, so scaling and unscaling fp32 gradients is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def amp_dtype(setting: str) -> torch.dtype | None:
    """The autocast dtype of `train.amp` (None: no autocast)."""
    if setting not in AMP_DTYPES:
        raise ValueError(f"train.amp={setting!r} is unknown; choose one of {tuple(AMP_DTYPES)}")
    return AMP_DTYPES[setting]


class LossScale:
    """A dynamic loss scale with `torch.amp.GradScaler`'s defaults, driven by whether each step was skipped."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0

    def update(self, skipped: bool) -> None:
        """After a step: an overflow (the step was skipped everywhere) halves the scale; `growth_interval` clean
        steps in a row double it."""
        if skipped:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def autocast_loss(per_example_loss: LossFn, device: torch.device, dtype: torch.dtype | None,
                  scale: LossScale | None = None) -> LossFn:
    """`per_example_loss` with its forward under autocast to `dtype` (as is, for None), returned in fp32 and
    multiplied by the loss scale when there is one (the caller unscales: `unscale`)."""
    if dtype is None:
        return per_example_loss

    def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=device.type, dtype=dtype):
            out = per_example_loss(model, inputs, targets)
        out = out.float()
        return out * scale.scale if scale is not None else out

    return loss


def unscale(scale: LossScale, grads: dict[torch.dtype, torch.Tensor], losses: torch.Tensor) -> None:
    """Divide the workers' gradients and losses by the loss scale, in place (exact: a power of two)."""
    for g in grads.values():
        g.mul_(1.0 / scale.scale)
    losses.mul_(1.0 / scale.scale)

