"""Global baselines: workers send fp32 gradients, the server averages, everyone applies an optimizer.

The optimizer is the library's own (`torch.optim.AdamW`, `timm.optim.Lion`) stepping on the flat
parameter buffer with the all-reduced mean gradient as its `.grad`: 32 bits up, 32 bits down.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.optim import Lion

from distlion.comm.message import Message
from distlion.methods.base import Method, StepContext


class GlobalOptimizer(Method):
    """Mean of the workers' fp32 gradients, applied by a torch optimizer built in `make_optimizer`."""

    exchange = "mean"  # an fp32 all-reduce

    def __init__(self, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.99)):
        super().__init__(lr, weight_decay)
        self.betas = tuple(float(b) for b in betas)
        self.optimizer: torch.optim.Optimizer | None = None
        self._leaf: torch.nn.Parameter | None = None

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        raise NotImplementedError

    def bind(self, params: torch.Tensor, num_workers: int, layout=None) -> Method:
        super().bind(params, num_workers, layout)
        # A Parameter wrapping the buffer shares its storage, so optimizer steps update the model.
        self._leaf = torch.nn.Parameter(params, requires_grad=True)
        self.optimizer = self.make_optimizer([self._leaf])
        return self

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        return Message({"grad": grad.to(torch.float32)})

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        total = torch.zeros_like(messages[0]["grad"])
        for m in messages:
            total += m["grad"]
        return Message({"mean_grad": total.div_(len(messages))})

    def apply_rule(self, down: Message, ctx: StepContext) -> None:
        self._leaf.grad = down["mean_grad"].to(self._leaf.dtype)
        for group in self.optimizer.param_groups:
            group["lr"] = ctx.lr
        self.optimizer.step()
        self._leaf.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def hparams(self) -> dict[str, Any]:
        return {**super().hparams(), "betas": self.betas}


class GlobalAdamW(GlobalOptimizer):
    """G-AdamW: `torch.optim.AdamW` on the all-reduced mean gradient."""

    name = "adamw"

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(lr, weight_decay, betas)
        self.eps = float(eps)

    def make_optimizer(self, params):
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


class GlobalLion(GlobalOptimizer):
    """G-Lion: `timm.optim.Lion` on the all-reduced mean gradient."""

    name = "lion"

    def __init__(self, lr: float = 1e-4, weight_decay: float = 0.0, betas=(0.9, 0.99)):
        super().__init__(lr, weight_decay, betas)

    def make_optimizer(self, params):
        return Lion(params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)
