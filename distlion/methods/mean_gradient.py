"""Methods whose apply rule is a library optimizer stepping on the decoded mean gradient.

The global baselines send the gradient fp32; TernGrad, GradDrop and DGC send it compressed. Either
way every worker decodes the downlink into the mean gradient and a `torch.optim` / `timm` optimizer
steps on the flat parameter buffer with it as `.grad`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from distlion.comm.message import Message
from distlion.methods.base import Method, StepContext

LIBRARY_OPTIMIZERS = ("sgd", "adamw")


def library_optimizer(
    name: str,
    params: list[torch.Tensor],
    lr: float,
    weight_decay: float,
    momentum: float,
    betas: tuple[float, float],
) -> torch.optim.Optimizer:
    """The optimizer a compression baseline applies its mean gradient with: SGD with momentum or AdamW."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)


def fp32_mean(messages: list[Message], key: str) -> torch.Tensor:
    """(1/N) sum_i of one fp32 tensor of the N messages."""
    total = torch.zeros_like(messages[0][key])
    for m in messages:
        total += m[key]
    return total.div_(len(messages))


class MeanGradientMethod(Method):
    """Apply rule: `decode` the downlink into the mean gradient, then one step of `make_optimizer`'s
    optimizer on the flat parameters."""

    def __init__(self, lr: float, weight_decay: float = 0.0):
        super().__init__(lr, weight_decay)
        self.torch_optimizer: torch.optim.Optimizer | None = None
        self._leaf: torch.nn.Parameter | None = None

    @abstractmethod
    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The library optimizer over `params` (one leaf sharing the flat buffer's storage)."""

    def decode(self, down: Message, ctx: StepContext) -> torch.Tensor:
        """The downlink as the mean gradient, fp32 [n]."""
        return down["mean_grad"]

    def bind(self, params: torch.Tensor, num_workers: int, layout=None) -> Method:
        super().bind(params, num_workers, layout)
        # A Parameter wrapping the buffer shares its storage, so optimizer steps update the model.
        self._leaf = torch.nn.Parameter(params, requires_grad=True)
        self.torch_optimizer = self.make_optimizer([self._leaf])
        return self

    def apply_rule(self, down: Message, ctx: StepContext) -> None:
        self._leaf.grad = self.decode(down, ctx).to(self._leaf.dtype)
        for group in self.torch_optimizer.param_groups:
            group["lr"] = ctx.lr
        self.torch_optimizer.step()
        self._leaf.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.torch_optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.torch_optimizer.load_state_dict(state)
