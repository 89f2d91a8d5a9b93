"""Deep Gradient Compression (Lin, Han, Mao, Wang & Dally 2018, arXiv 1712.01887)."""

from __future__ import annotations

import math
from typing import Any

import torch

from distlion.comm.message import Message
from distlion.flat import Segment
from distlion.methods.base import Method, StepContext, check_fraction
from distlion.methods.registry import MethodInfo, register
from distlion.methods.sparse import SparseMeanMethod, exact_topk, num_kept

# Threshold sampling, as in the reference code (github.com/synxlin/deep-gradient-compression).
SAMPLE_RATIO = 0.01  # fraction of |v| sampled for the threshold
UPPER_BOUND = 1.3  # more than 1.3 k selected: exact top-k among the selected
LOWER_BOUND = 0.8  # fewer than 0.8 k selected: lower the threshold by this factor and retry
MAX_ADAPTATIONS = 10


def sampled_topk(importance: torch.Tensor, keep: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of about k = ceil(keep * n) of the largest entries of `importance` (>= 0).

    The threshold is the ceil(keep * m)-th largest of m random samples (m = 1% of n, and at least
    2 / keep so the sample holds ~2 entries above it); then adjusted: more than 1.3 k above it ->
    the exact top-k of those; fewer than 0.8 k -> threshold * 0.8, up to 10 times. So the count is
    k, or within [0.8 k, 1.3 k] unless 10 lowerings were not enough.
    """
    n = importance.numel()
    k = num_kept(n, keep)
    num_samples = max(math.ceil(n * SAMPLE_RATIO), math.ceil(2 / keep))
    if num_samples >= n:
        return exact_topk(importance, k)
    samples = importance[torch.randint(n, (num_samples,), generator=generator, device=importance.device)]
    threshold = samples.topk(num_kept(num_samples, keep)).values[-1]
    for _ in range(MAX_ADAPTATIONS):
        idx = (importance >= threshold).nonzero().squeeze(1)
        if idx.numel() > UPPER_BOUND * k:
            return idx[exact_topk(importance[idx], k)]
        if idx.numel() >= LOWER_BOUND * k:
            break
        threshold = threshold * LOWER_BOUND
    return idx[importance[idx] > 0]


class DGC(SparseMeanMethod):
    """DGC: momentum correction, local clipping, momentum factor masking, warm-up; each switchable.

    Worker i (u_i momentum, v_i velocity; never synchronized), gradient g_i:
        local clipping:      g_i = g_i * min(1, sqrt(N) * clip_norm / ||g_i||)
        momentum correction: u_i = m * u_i + g_i;   v_i = v_i + u_i
        send sparse(v_i), the top-k of |v_i| per weight matrix; then v_i = 0 where sent
        (the rest stays local), and with momentum masking also u_i = 0 where sent.
    Server: Delta = (1/N) sum_i sparse(v_i). Every worker: x = x - lr * (Delta + b), plain SGD
    with no second momentum; b = m * b + wd * x carries the weight decay, as the reference
    optimizer DGCSGD does (decay with momentum, outside the compression). With sparsity 0 and
    clipping, masking and warm-up off this is `torch.optim.SGD(momentum=m, weight_decay=wd)` on the
    mean gradient (up to float rounding), since the mean of the workers' momenta is the momentum of
    the mean.
    Nesterov momentum (an option of the reference code, off there by default) is not provided.

    Clipping: the paper clips the worker's share G_i = g_i / N of the global gradient sum_i G_i at
    N^(-1/2) * clip_norm, the worker's part of the global threshold if all N workers had identical
    gradient distributions (||sum_i G_i|| ~ sqrt(N) ||G_i||). In terms of the worker's own mean
    gradient g_i, which the server averages, that is its whole-buffer L2 norm at sqrt(N) * clip_norm.

    Only weight matrices (segments of dim > 1) are sparsified, as in the reference code; biases and
    norms send u_i dense fp32 (no velocity, no masking). A layout with no matrix at all (a bare flat
    buffer) is sparsified whole.

    Warm-up: in epoch e < warmup_epochs the sparsity is min(sparsity, 1 - warmup_coeff^(e + 1)):
    75%, 93.75%, 98.4375%, 99.6%, 99.9% by default, then `sparsity` (99.9%). The reference code's
    default coefficient is not 0.25 unless passed explicitly; here it is the default.

    The top-k threshold comes from a 1% sample of |v| (`sampled_topk`), or is exact with
    `exact_topk=True`. Bits: 64 per sent entry + 32 per dense element up; down, see `SparseMeanMethod`.
    """

    name = "dgc"

    def __init__(
        self,
        lr: float = 0.01,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        sparsity: float = 0.999,
        clip_norm: float | None = 1.0,
        momentum_masking: bool = True,
        warmup_epochs: int = 5,
        warmup_coeff: float = 0.25,
        exact_topk: bool = False,
    ):
        super().__init__(lr, weight_decay)
        check_fraction("sparsity", sparsity, "0 sends everything; the paper uses 0.999")
        check_fraction("momentum", momentum, "the paper uses 0.9")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(
                f"method.clip_norm={clip_norm} must be > 0; set a positive norm, or null for no clipping"
            )
        if warmup_epochs < 0:
            raise ValueError(f"method.warmup_epochs={warmup_epochs} must be >= 0 (0 = no warm-up)")
        if not 0 < warmup_coeff < 1:
            raise ValueError(f"method.warmup_coeff={warmup_coeff} must be in (0, 1); the paper's is 0.25")
        self.momentum = float(momentum)
        self.sparsity = float(sparsity)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.momentum_masking = bool(momentum_masking)
        self.warmup_epochs = int(warmup_epochs)
        self.warmup_coeff = float(warmup_coeff)
        self.exact_topk = bool(exact_topk)
        self.decay: torch.Tensor | None = None

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr)

    def sparsifies(self, segment: Segment) -> bool:
        return segment.is_matrix or not any(s.is_matrix for s in self.layout)

    def bind(self, params: torch.Tensor, num_workers: int, layout=None) -> Method:
        super().bind(params, num_workers, layout)
        self.decay = torch.zeros_like(params, dtype=torch.float32) if self.weight_decay else None
        return self

    def check_run(self, total_epochs: float) -> None:
        if self.warmup_epochs > total_epochs:
            raise ValueError(
                f"method.warmup_epochs={self.warmup_epochs} is longer than the run ({total_epochs} epochs); "
                "lower it or train longer"
            )

    def sparsity_at(self, epoch: float) -> float:
        """The warm-up schedule: the sparsity used in (float) epoch `epoch`."""
        e = math.floor(epoch)
        if e < self.warmup_epochs:
            return min(self.sparsity, 1 - self.warmup_coeff ** (e + 1))
        return self.sparsity

    def init_worker_state(self) -> dict[str, torch.Tensor]:
        zeros = torch.zeros_like(self.params, dtype=torch.float32)
        return {"momentum": zeros, "velocity": zeros.clone()}

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        u, v = state["momentum"], state["velocity"]
        g = grad.to(torch.float32)
        if self.clip_norm is not None:
            limit = math.sqrt(ctx.num_workers) * self.clip_norm
            norm = float(g.norm())
            if norm > limit:
                g = g * (limit / norm)
        u.mul_(self.momentum).add_(g)
        keep = 1 - self.sparsity_at(ctx.epoch)
        generator = ctx.generator(v.device)
        sent = []
        for s in self.sparse_segments:
            vs = v[s.offset : s.stop].add_(u[s.offset : s.stop])
            if self.exact_topk or keep == 1:
                idx = exact_topk(vs.abs(), num_kept(s.numel, keep))
            else:
                idx = sampled_topk(vs.abs(), keep, generator)
            sent.append(idx + s.offset)
        idx = torch.cat(sent) if sent else torch.zeros(0, dtype=torch.int64, device=v.device)
        message = self.uplink(idx, v, u)
        v[idx] = 0
        if self.momentum_masking:
            u[idx] = 0
        return message

    def apply_rule(self, down: Message, ctx: StepContext) -> None:
        if self.decay is not None:  # b = m * b + wd * x, from the parameters before this step
            self.decay.mul_(self.momentum).add_(self.params, alpha=self.weight_decay)
        super().apply_rule(down, ctx)

    def decode(self, down: Message, ctx: StepContext) -> torch.Tensor:
        """The mean update plus the decay momentum b (weight decay stays outside the compression)."""
        update = super().decode(down, ctx)
        return update if self.decay is None else update + self.decay

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": super().state_dict(), "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state["optimizer"])
        if self.decay is not None:
            self.decay.copy_(state["decay"])


register(MethodInfo("dgc", DGC, "DGC", "sparse", "(64*k + 32*n_dense)/n", "min(64*U + 32*n_dense, 32*n)/n", order=10,
                    summary="top-k of momentum-corrected velocity, 99.9% sparsity after warm-up (Lin et al. 2018)"))
