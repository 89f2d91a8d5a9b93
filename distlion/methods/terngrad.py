"""TernGrad (Wen et al. 2017, "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
Learning", arXiv 1705.07878)."""

from __future__ import annotations

import torch

from distlion.comm.message import Message
from distlion.comm.packing import pack_bits, uint_width, unpack_bits
from distlion.comm.voting import count_votes
from distlion.methods.base import StepContext, check_betas, check_choice, check_fraction
from distlion.methods.mean_gradient import LIBRARY_OPTIMIZERS, MeanGradientMethod, fp32_mean, library_optimizer
from distlion.methods.registry import MethodInfo, register


def add_planes(a: torch.Tensor, b: torch.Tensor, shift: int, width: int) -> torch.Tensor:
    """a + b * 2^shift on unsigned bit-planes uint8 [w, B] (LSB first) -> [width, B], ripple carry."""
    zero = torch.zeros_like(a[0])
    out, carry = [], zero
    for j in range(width):
        x = a[j] if j < len(a) else zero
        y = b[j - shift] if 0 <= j - shift < len(b) else zero
        out.append(x ^ y ^ carry)
        carry = (x & y) | (carry & (x ^ y))
    return torch.stack(out)


class TernGrad(MeanGradientMethod):
    """Stochastic ternary gradients with a scaler per layer shared by all workers.

    Worker i, per layer l (one parameter tensor of the layout), gradient g:
        clipping:   g = clamp(g, -c * std(g), c * std(g))      (c = `clip`; std over the layer)
        scaler:     s_i = max|g|
        ternary:    g~ = S * sign(g) * b,  b ~ Bernoulli(|g| / S),  so E[g~] = g
    where S = max_i s_i is the scaler shared by the N workers (the paper's scaler sharing), so
    |g| <= S keeps every probability in [0, 1] and the server's sum of ternaries is an integer
    in [-N, N]. Server: the integer sums; every worker: Delta = S * sum_i t_i / N, applied by the
    base optimizer (SGD with momentum as in the paper; AdamW as an option).

    Scaler sharing needs the workers to agree on S before they ternarize, so a step has a small
    pre-exchange before the main one (`pre_exchange`, all-gathered in a multi-process backend):
        pre_worker_rule -> `scalers` fp32 [L] (32 bits per layer up)
        pre_server_rule -> `scalers` = elementwise max (32 bits per layer down)
        pre_apply_rule  stores S for this step on every worker
    Bits per step, pre-exchange included, with n parameters in L layers:
        up:   2 bits per element (codes t + 1 in {0, 1, 2} as two bit-planes) + 32 L
        down: ceil(log2(2N + 1)) bits per element (sums + N in [0, 2N] as bit-planes) + 32 L
    Bit-planes pad each plane to whole bytes: at most 7 bits per plane per step.

    With `ternarize=False` workers send the clipped gradient fp32 (no pre-exchange) and the method is
    the base optimizer on the mean gradient. Clipping leaves a layer with std 0 as it is, since
    clipping it at 0 would erase it. `clip=None` switches clipping off.
    """

    name = "terngrad"

    def __init__(
        self,
        lr: float = 0.01,
        weight_decay: float = 0.0,
        clip: float | None = 2.5,
        ternarize: bool = True,
        optimizer: str = "sgd",
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
    ):
        super().__init__(lr, weight_decay)
        if clip is not None and not clip > 0:
            raise ValueError(
                f"method.clip={clip} must be > 0; the paper uses 2.5, null switches clipping off"
            )
        check_choice("optimizer", optimizer, LIBRARY_OPTIMIZERS)
        self.clip = None if clip is None else float(clip)
        self.ternarize = bool(ternarize)
        self.optimizer = optimizer
        check_fraction("momentum", momentum, "the SGD momentum; the paper uses 0.9")
        self.momentum = float(momentum)
        self.betas = check_betas(betas)
        self._shared: tuple[int, torch.Tensor] | None = None

    @property
    def exchange(self) -> str:
        """The sum of codes is bytewise on bit-planes (sharded); unternarized fp32 is an all-reduce."""
        return "sharded" if self.ternarize else "mean"

    @property
    def pre_exchange(self) -> str | None:
        """The scalers, all-gathered; no pre-exchange without ternarization."""
        return "allgather" if self.ternarize else None

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return library_optimizer(
            self.optimizer, params, self.lr, self.weight_decay, self.momentum, self.betas
        )

    def clip_limit(self, layer: torch.Tensor) -> torch.Tensor | None:
        """c * std of a layer (population std), or None when clipping is off or the std is 0
        (clipping at 0 would erase the layer)."""
        if self.clip is None:
            return None
        std = layer.std(correction=0)
        return self.clip * std if std > 0 else None

    def clipped(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient fp32 with each layer clamped at +-clip * std."""
        g = grad.to(torch.float32, copy=True)
        for s in self.layout:
            layer = g[s.offset : s.stop]
            limit = self.clip_limit(layer)
            if limit is not None:
                layer.clamp_(-limit, limit)
        return g

    def pre_worker_rule(
        self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext
    ) -> Message:
        """Worker i's scalers s_i = max|clip(g)| = min(max|g|, c * std) per layer, fp32 [L]."""
        scalers = []
        for s in self.layout:
            layer = grad[s.offset : s.stop].to(torch.float32)
            scaler, limit = layer.abs().max(), self.clip_limit(layer)
            scalers.append(scaler if limit is None else torch.minimum(scaler, limit))
        return Message({"scalers": torch.stack(scalers)})

    def pre_server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        """S = max_i s_i per layer."""
        return Message({"scalers": torch.stack([m["scalers"] for m in messages]).amax(dim=0)})

    def pre_apply_rule(self, down: Message, ctx: StepContext) -> None:
        """Every worker keeps S for this step's worker rule and apply rule."""
        self._shared = (ctx.step, down["scalers"])

    def shared_scalers(self, step: int) -> torch.Tensor:
        if self._shared is None or self._shared[0] != step:
            raise RuntimeError(
                f"terngrad has no shared scalers for step {step}: run the pre-exchange "
                "(pre_worker_rule, pre_server_rule, pre_apply_rule) before the worker rules"
            )
        return self._shared[1]

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        if not self.ternarize:
            return Message({"grad": self.clipped(grad)})
        scalers = self.shared_scalers(ctx.step)
        g = grad.to(torch.float32)
        # b = [U * S < |clip(g)|] with U ~ U[0, 1): Bernoulli(|g| / S), and never 1 where S = 0.
        uniform = torch.rand(g.numel(), generator=ctx.generator(g.device), device=g.device)
        keep = torch.empty(g.numel(), dtype=torch.bool, device=g.device)
        for s, scaler in zip(self.layout, scalers, strict=True):
            layer = g[s.offset : s.stop]
            magnitude = layer.abs()
            limit = self.clip_limit(layer)
            if limit is not None:
                magnitude.clamp_(max=limit)
            torch.lt(uniform[s.offset : s.stop].mul_(scaler), magnitude, out=keep[s.offset : s.stop])
        # The code t + 1 in {0, 1, 2} as two bit-planes: bit 0 is [t = 0], bit 1 is [t = +1].
        return Message({"codes": torch.stack([pack_bits(~keep), pack_bits(keep & (g > 0))])})

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        if not self.ternarize:
            return Message({"mean_grad": fp32_mean(messages, "grad")})
        codes = torch.stack([m["codes"] for m in messages])
        # sum_i (t_i + 1) = #[t_i = 0] + 2 #[t_i = +1], counted and added on packed bit-planes.
        zeros, plus = count_votes(codes[:, 0]), count_votes(codes[:, 1])
        return Message({"sums": add_planes(zeros, plus, shift=1, width=uint_width(2 * len(messages)))})

    def decode(self, down: Message, ctx: StepContext) -> torch.Tensor:
        """The downlink as the mean gradient, fp32 [n]: S * sum_i t_i / N."""
        if not self.ternarize:
            return down["mean_grad"]
        n, num_workers = self.params.numel(), ctx.num_workers
        planes = down["sums"]
        sums = torch.zeros(n, dtype=torch.uint8 if len(planes) <= 8 else torch.int32, device=planes.device)
        for j, plane in enumerate(planes):
            sums |= unpack_bits(plane, n).to(sums.dtype) << j
        total = sums.to(torch.float32)
        for s, scaler in zip(self.layout, self.shared_scalers(ctx.step), strict=True):
            total[s.offset : s.stop].sub_(num_workers).mul_(scaler / num_workers)
        return total


register(MethodInfo("terngrad", TernGrad, "TernGrad", "quantized", "2 + 32*L/n", "ceil(log2(2*N + 1)) + 32*L/n",
                    order=8, summary="stochastic ternary, per-layer scaler shared by max (Wen et al. 2017)"))
