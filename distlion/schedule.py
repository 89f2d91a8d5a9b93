"""Learning-rate schedules from timm, applied to every method the same way.

timm's schedulers drive an optimizer's param groups; our methods take the step's lr explicitly
(ctx.lr), so a one-parameter "lr carrier" optimizer holds the schedule and every method reads the
scheduled value from it each step. No method ever falls back to its base lr (the Lion Cub bug).
"""

from __future__ import annotations

import torch
from timm.scheduler import CosineLRScheduler


class LRSchedule:
    """lr(step): linear warm-up over `warmup_steps`, then `name` ("cosine" or "constant")."""

    def __init__(
        self, base_lr: float, total_steps: int, name: str = "cosine", warmup_steps: int = 0, min_lr_ratio: float = 0.0
    ):
        if name not in ("cosine", "constant"):
            raise ValueError(f"schedule.name={name!r} is unknown; choose 'cosine' or 'constant'")
        if warmup_steps > total_steps:
            raise ValueError(f"schedule.warmup_steps={warmup_steps} is longer than the run ({total_steps} steps); "
                             "lower it or train longer")
        self._carrier = torch.optim.SGD([torch.zeros(1, requires_grad=True, device="cpu")], lr=base_lr)
        self._scheduler = CosineLRScheduler(
            self._carrier,
            t_initial=max(total_steps - warmup_steps, 1) if name == "cosine" else 10**12,
            lr_min=base_lr * min_lr_ratio if name == "cosine" else base_lr,
            warmup_t=warmup_steps,
            warmup_lr_init=0.0,
            warmup_prefix=True,
            t_in_epochs=False,
        )

    def __call__(self, step: int) -> float:
        # Step t uses the value at t + 1, so warm-up starts at base_lr / warmup_steps rather than 0.
        self._scheduler.step_update(step + 1)
        return self._carrier.param_groups[0]["lr"]
