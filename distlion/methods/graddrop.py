"""Gradient Dropping (Aji & Heafield 2017, "Sparse Communication for Distributed Gradient Descent",
arXiv 1704.05021)."""

from __future__ import annotations

import torch

from distlion.comm.message import Message
from distlion.methods.base import StepContext, check_betas, check_choice, check_fraction
from distlion.methods.mean_gradient import LIBRARY_OPTIMIZERS, library_optimizer
from distlion.methods.registry import MethodInfo, register
from distlion.methods.sparse import SparseMeanMethod, exact_topk, num_kept

THRESHOLDS = ("global", "layer")


class GradDrop(SparseMeanMethod):
    """Gradient Dropping: send the largest entries of gradient + residual, keep the rest as residual.

    Worker i (residual r_i, never synchronized):
        r_i = r_i + g_i
        send r_i[j] for the j with |r_i[j]| in the top (1 - drop_ratio) fraction, then r_i[j] = 0
    The top set is exact (`exact_topk`), k = ceil((1 - drop_ratio) * n) per threshold domain:
      global: one threshold over the whole buffer;
      layer:  one per parameter tensor, so a layer with small gradients still sends its largest.
    Server and downlink: see `SparseMeanMethod`. Every worker applies the mean with the base
    optimizer (AdamW by default, SGD with momentum as an option). Up: 64 bits per sent entry.
    """

    name = "graddrop"

    def __init__(
        self,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        drop_ratio: float = 0.99,
        threshold: str = "global",
        optimizer: str = "adamw",
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
    ):
        super().__init__(lr, weight_decay)
        check_fraction("drop_ratio", drop_ratio, "0 sends everything; the paper drops 0.99")
        check_choice("threshold", threshold, THRESHOLDS)
        check_choice("optimizer", optimizer, LIBRARY_OPTIMIZERS)
        self.drop_ratio = float(drop_ratio)
        self.threshold = threshold
        self.optimizer = optimizer
        check_fraction("momentum", momentum, "the SGD momentum; 0.9 is usual")
        self.momentum = float(momentum)
        self.betas = check_betas(betas)

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return library_optimizer(
            self.optimizer, params, self.lr, self.weight_decay, self.momentum, self.betas
        )

    def init_worker_state(self) -> dict[str, torch.Tensor]:
        return {"residual": torch.zeros_like(self.params, dtype=torch.float32)}

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        residual = state["residual"].add_(grad)
        importance = residual.abs()
        keep = 1 - self.drop_ratio
        if self.threshold == "global":
            idx = exact_topk(importance, num_kept(importance.numel(), keep))
        else:
            idx = torch.cat(
                [
                    exact_topk(importance[s.offset : s.stop], num_kept(s.numel, keep)) + s.offset
                    for s in self.layout
                ]
            )
        message = self.uplink(idx, residual, residual)
        residual[idx] = 0
        return message


register(MethodInfo("graddrop", GradDrop, "GradDrop", "sparse", "64*k/n", "min(64*U, 32*n)/n", order=9,
                    summary="top 1% of gradient + residual (Aji & Heafield 2017)"))
