"""Global baselines: workers send fp32 gradients, the server averages, everyone applies an optimizer.

The optimizer is the library's own (`torch.optim.AdamW`, `timm.optim.Lion`) stepping on the flat
parameter buffer with the all-reduced mean gradient as its `.grad`: 32 bits up, 32 bits down.
"""

from __future__ import annotations

import torch
from timm.optim import Lion

from distlion.comm.message import Message
from distlion.methods.base import StepContext, check_betas
from distlion.methods.mean_gradient import MeanGradientMethod, fp32_mean
from distlion.methods.registry import MethodInfo, register


class GlobalMeanGradient(MeanGradientMethod):
    """Every worker's gradient fp32 up, their mean fp32 down (an all-reduce)."""

    exchange = "mean"

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        return Message({"grad": grad.to(torch.float32)})

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        return Message({"mean_grad": fp32_mean(messages, "grad")})


class GlobalAdamW(GlobalMeanGradient):
    """G-AdamW: `torch.optim.AdamW` on the all-reduced mean gradient."""

    name = "adamw"

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(lr, weight_decay)
        self.betas = check_betas(betas)
        if not eps > 0:
            raise ValueError(f"method.eps={eps} must be > 0 (AdamW's default is 1e-8)")
        self.eps = float(eps)

    def make_optimizer(self, params):
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


class GlobalLion(GlobalMeanGradient):
    """G-Lion: `timm.optim.Lion` on the all-reduced mean gradient."""

    name = "lion"

    def __init__(self, lr: float = 1e-4, weight_decay: float = 0.0, betas=(0.9, 0.99)):
        super().__init__(lr, weight_decay)
        self.betas = check_betas(betas)

    def make_optimizer(self, params):
        return Lion(params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)


register(MethodInfo("adamw", GlobalAdamW, "G-AdamW", "global", "32", "32", order=0,
                    summary="`torch.optim.AdamW` on the mean gradient"))
register(MethodInfo("lion", GlobalLion, "G-Lion", "global", "32", "32", order=1,
                    summary="`timm.optim.Lion` on the mean gradient"))
