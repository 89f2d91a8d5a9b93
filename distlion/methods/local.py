"""Local-update methods: each worker steps its own parameters for H steps, then they meet.

LocalSGD / FedAvg (Stich 2019; McMahan et al. 2017): H steps of an inner optimizer (AdamW or Lion) on the
worker's replica, then the replicas are averaged: 32 bits up and 32 down per parameter every H steps.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): every worker starts its H inner AdamW steps from the global
parameters; the outer gradient is the global parameters minus the mean of the workers' local ones, and an
outer Nesterov SGD (lr 0.7, momentum 0.9) steps the global parameters, which every worker then takes. The
outer gradient is exchanged in fp32 (32 / 32 bits per parameter every H steps), bf16 (16 / 16), int8 with a
per-layer scale (8 + 32 L/n each way) or signed and voted like D-Lion (1 / 1): each worker sends the sign of
its outer gradient plus its error-feedback residual (Karimireddy et al. 2019), the server's majority vote
comes back, and the outer optimizer steps on the voted signs (then `outer_lr` is a sign step, as Lion's lr).

The inner optimizers are the library's (`torch.optim.AdamW`, `timm.optim.Lion`), and so is the outer one
(`torch.optim.SGD`). Exchanges run in worker order ("allgather"), so one process and N ranks agree bitwise.
Between syncs a worker sends nothing (an empty message: 0 bits, no collective).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from timm.optim import Lion

from distlion.comm.message import Message
from distlion.comm.packing import pack_bits, unpack_signs
from distlion.comm.voting import majority_vote, majority_vote_counts, tie_bits
from distlion.methods.base import Method, StepContext, check_betas, check_choice, check_fraction, mean_in_order
from distlion.methods.registry import MethodInfo, register

INNER = ("adamw", "lion", "sgd")
OUTER_GRADS = ("fp32", "bf16", "int8", "sign")


def inner_optimizer(name: str, params: list[torch.Tensor], lr: float, weight_decay: float,
                    betas: tuple[float, float]) -> torch.optim.Optimizer:
    """A worker's inner optimizer: `torch.optim.AdamW`, `timm.optim.Lion` or plain `torch.optim.SGD`."""
    if name == "lion":
        return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)


class LocalUpdates(Method):
    """What the local-update methods share: a replica per worker stepped by an inner optimizer, a sync every
    `sync_every` steps."""

    replicas = True
    exchange = "allgather"

    def __init__(self, lr: float, weight_decay: float, sync_every: int, inner: str, betas: tuple[float, float]):
        super().__init__(lr, weight_decay)
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"method.sync_every={sync_every!r} must be a whole number of steps >= 1")
        check_choice("inner", inner, INNER)
        self.sync_every = sync_every
        self.inner = inner
        self.betas = check_betas(betas)

    def bind(self, params: torch.Tensor, num_workers: int, layout=None) -> Method:
        super().bind(params, num_workers, layout)
        # A Parameter over this worker's replica: the inner optimizer's steps update it in place.
        self._leaf = torch.nn.Parameter(params, requires_grad=True)
        self.inner_opt = inner_optimizer(self.inner, [self._leaf], self.lr, self.weight_decay, self.betas)
        return self

    def syncs(self, ctx: StepContext) -> bool:
        return (ctx.step + 1) % self.sync_every == 0 or ctx.final_sync

    def sync_count(self, steps: int, final_sync: bool) -> int:
        """How many syncs a run of `steps` steps makes: every H-th step, and the last with `final_sync`."""
        return steps // self.sync_every + int(final_sync and steps % self.sync_every != 0)

    def inner_step(self, grad: torch.Tensor, lr: float) -> None:
        self._leaf.grad = grad.to(self._leaf.dtype)
        for group in self.inner_opt.param_groups:
            group["lr"] = lr
        self.inner_opt.step()
        self._leaf.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner_opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner_opt.load_state_dict(state["inner"])


class LocalSGD(LocalUpdates):
    """LocalSGD / FedAvg: H inner steps on each replica, then the replicas' mean, fp32 up and down."""

    name = "localsgd"

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.0, sync_every: int = 10, inner: str = "adamw",
                 betas: tuple[float, float] = (0.9, 0.999)):
        super().__init__(lr, weight_decay, sync_every, inner, betas)

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        self.inner_step(grad, ctx.lr)
        return Message({"params": self.params.to(torch.float32).clone()}) if self.syncs(ctx) else Message()

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        if not messages[0].tensors:
            return Message()
        return Message({"mean": mean_in_order([m["params"] for m in messages])})

    def apply_rule(self, down: Message, ctx: StepContext) -> None:
        if down.tensors:
            self.params.copy_(down["mean"])


class DiLoCo(LocalUpdates):
    """DiLoCo: inner AdamW from the global parameters, outer Nesterov SGD on (global - mean of the locals)."""

    name = "diloco"

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.0, sync_every: int = 50, inner: str = "adamw",
                 betas: tuple[float, float] = (0.9, 0.95), outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, outer_grad: str = "fp32"):
        super().__init__(lr, weight_decay, sync_every, inner, betas)
        if not outer_lr > 0:
            raise ValueError(f"method.outer_lr={outer_lr} must be > 0 (DiLoCo's is 0.7)")
        check_fraction("outer_momentum", outer_momentum, "DiLoCo's is 0.9")
        check_choice("outer_grad", outer_grad, OUTER_GRADS)
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.outer_grad = outer_grad

    def bind(self, params: torch.Tensor, num_workers: int, layout=None) -> Method:
        super().bind(params, num_workers, layout)
        self.global_params = torch.nn.Parameter(params.detach().to(torch.float32).clone(), requires_grad=True)
        self.outer_opt = torch.optim.SGD([self.global_params], lr=self.outer_lr, momentum=self.outer_momentum,
                                         nesterov=self.nesterov and self.outer_momentum > 0)
        return self

    def init_worker_state(self) -> dict[str, torch.Tensor]:
        # The signed outer gradient's error feedback: what the sent signs left out, added to the next one.
        return {"residual": torch.zeros_like(self.params, dtype=torch.float32)} if self.outer_grad == "sign" else {}

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        self.inner_step(grad, ctx.lr)
        if not self.syncs(ctx):
            return Message()
        delta = self.global_params.detach() - self.params.to(torch.float32)
        if self.outer_grad == "fp32":
            return Message({"delta": delta})
        if self.outer_grad == "bf16":
            return Message({"delta": delta.to(torch.bfloat16)})
        if self.outer_grad == "int8":
            return Message(self._int8(delta))
        corrected = delta + state["residual"]
        signs = corrected > 0
        scale = corrected.abs().mean()  # EF-signSGD's scaled sign: the residual keeps what it leaves out
        state["residual"] = corrected - scale * (signs.to(torch.float32) * 2 - 1)
        return Message({"signs": pack_bits(signs)})

    def _int8(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per layer: int8 codes round(127 v / max|v|) and the fp32 scale max|v| / 127."""
        scales = torch.stack([values[s.offset : s.stop].abs().amax() / 127 for s in self.layout])
        per_entry = torch.cat([scales[i].expand(s.numel) for i, s in enumerate(self.layout)])
        codes = torch.where(per_entry > 0, values / per_entry.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        return {"codes": codes.round_().clamp_(-127, 127).to(torch.int8), "scales": scales}

    def _from_int8(self, message: Message) -> torch.Tensor:
        per_entry = torch.cat([message["scales"][i].expand(s.numel) for i, s in enumerate(self.layout)])
        return message["codes"].to(torch.float32) * per_entry

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        if not messages[0].tensors:
            return Message()
        if self.outer_grad == "sign":
            signs = torch.stack([m["signs"] for m in messages])
            tie = tie_bits("alternate", signs.shape[1], ctx.step, signs.device)
            return Message({"vote": majority_vote(signs, tie)})
        if self.outer_grad == "int8":
            return Message(self._int8(mean_in_order([self._from_int8(m) for m in messages])))
        mean = mean_in_order([m["delta"] for m in messages])
        return Message({"delta": mean.to(torch.bfloat16) if self.outer_grad == "bf16" else mean})

    def vote_diagnostics(self, sent: list[Message], down: Message, num_workers: int) -> dict[str, torch.Tensor]:
        """The voted outer gradient's agreement and margins at a sync step (`majority_vote_counts`, as D-Lion's
        MaVo); nothing between syncs or for the other outer gradients."""
        if self.outer_grad != "sign" or not down.tensors:
            return {}
        return majority_vote_counts([m["signs"] for m in sent], down["vote"], self.params.numel(), num_workers)

    def decode(self, down: Message) -> torch.Tensor:
        """The downlink as the outer gradient, fp32 [n]."""
        if self.outer_grad == "sign":
            out = torch.empty(8 * down["vote"].numel(), dtype=torch.float32, device=self.params.device)
            return unpack_signs(down["vote"], self.params.numel(), out)
        if self.outer_grad == "int8":
            return self._from_int8(down)
        return down["delta"].to(torch.float32)

    def apply_rule(self, down: Message, ctx: StepContext) -> None:
        if not down.tensors:
            return
        self.global_params.grad = self.decode(down)
        self.outer_opt.step()
        self.global_params.grad = None
        self.params.copy_(self.global_params.detach())

    def counted_params(self, gather_replicas: Callable[[], list[torch.Tensor]]) -> torch.Tensor:
        """The global parameters (every worker holds them): what DiLoCo evaluates and ships."""
        return self.global_params.detach().to(self.params.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "global": self.global_params.detach().clone(),
                "outer": self.outer_opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.global_params.data.copy_(state["global"])
        self.outer_opt.load_state_dict(state["outer"])


register(MethodInfo("localsgd", LocalSGD, "LocalSGD", "local", "32/H", "32/H", order=16,
                    summary="H steps of AdamW (or Lion) on each worker's own parameters, then their mean",
                    reference="Stich 2019; McMahan et al. 2017"))
register(MethodInfo("diloco", DiLoCo, "DiLoCo", "local", "32/H", "32/H", order=17,
                    summary="H inner AdamW steps, outer Nesterov SGD on the mean parameter change",
                    reference="Douillard et al. 2023, arXiv 2311.08105"))
register(MethodInfo("diloco_bf16", DiLoCo, "DiLoCo (bf16)", "local", "16/H", "16/H", order=18,
                    fixed={"outer_grad": "bf16"}, summary="DiLoCo with the outer gradient sent in bf16"))
register(MethodInfo("diloco_int8", DiLoCo, "DiLoCo (int8)", "local", "(8 + 32*L/n)/H", "(8 + 32*L/n)/H", order=19,
                    fixed={"outer_grad": "int8"},
                    summary="DiLoCo with the outer gradient sent in int8, a scale per layer"))
register(MethodInfo("diloco_sign", DiLoCo, "DiLoCo (sign, MaVo)", "local", "1/H", "1/H", order=20,
                    fixed={"outer_grad": "sign"},
                    summary="DiLoCo with the outer gradient signed (error feedback) and majority-voted like D-Lion"))
