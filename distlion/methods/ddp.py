"""What users run today: `DistributedDataParallel`, its all-reduce per bucket overlapped with backward.

    torchrun --nproc-per-node 4 -m distlion.train cluster=torchdist method=ddp            # fp32 all-reduce
    ... method=ddp_bf16                                   # DDP's bf16_compress_hook (16 bits each way)
    ... method=powersgd method.rank=4                     # torch's powerSGD_hook (Vogels et al. 2019)

The gradient is averaged inside backward by the library's own comm hook (`default_hooks.allreduce_hook`,
`bf16_compress_hook`, `fp16_compress_hook`, `powerSGD_hook`), bucket by bucket as gradients become
ready; then AdamW (or Lion) steps on it. So the exchange is not one of the step loop's: it ran in
backward (`exchange = "in_backward"`), and `distlion.cluster.ddp.DDPGradients` wraps the model.

Bits are counted from what the hooks hand to `all_reduce` (every payload tensor, by its size and dtype):
the hooks' modules see `torch.distributed` through `_CountingDist`, which logs each all-reduced tensor
while a `PayloadLog` is recording and is otherwise `torch.distributed` itself. An all-reduce of b bits
per entry counts b up and b down, as the global baselines' 32 + 32. PowerSGD sends, per bucket, the
tensors it does not compress (vectors, and matrices too small to gain 2x) fp32, then P (rows x rank)
and Q (cols x rank) of each compressed matrix fp32; during its first `start_iter` steps a plain fp32
all-reduce. DDP runs only with one process per worker: the simulated cluster cannot run these methods.
"""

from __future__ import annotations

import types
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from timm.optim import Lion
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from distlion.comm.message import Message
from distlion.methods.base import StepContext, check_betas, check_choice
from distlion.methods.mean_gradient import MeanGradientMethod
from distlion.methods.registry import MethodInfo, register

COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
OPTIMIZERS = ("adamw", "lion")


class PayloadLog:
    """The tensors the comm hooks all-reduce while recording (as meta tensors: size and dtype only)."""

    active: ClassVar[PayloadLog | None] = None

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def __enter__(self) -> PayloadLog:
        PayloadLog.active = self
        return self

    def __exit__(self, *exc: object) -> None:
        PayloadLog.active = None


class _CountingDist(types.ModuleType):
    """`torch.distributed` as the hook modules see it: `all_reduce` also logs its tensor."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if PayloadLog.active is not None:
            PayloadLog.active.sent.append(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
        return dist.all_reduce(tensor, *args, **kwargs)


for _module in (default_hooks, powerSGD_hook):
    _module.dist = _CountingDist("torch.distributed")


class DDPMethod(MeanGradientMethod):
    """A library optimizer on the gradient that DDP's comm hook averaged during backward."""

    name = "ddp"
    exchange = "in_backward"
    #: Cluster backends that can run it: DDP needs one process per worker.
    backends: ClassVar[tuple[str, ...]] = ("torchdist",)

    def __init__(
        self,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        optimizer: str = "adamw",
        compression: str = "none",
        betas: tuple[float, float] | None = None,
        rank: int = 4,
        start_iter: int = 10,
        error_feedback: bool = True,
        warm_start: bool = True,
        bucket_cap_mb: float = 25.0,
    ):
        super().__init__(lr, weight_decay)
        check_choice("optimizer", optimizer, OPTIMIZERS)
        check_choice("compression", compression, COMPRESSIONS)
        self.optimizer = optimizer
        self.compression = compression
        self.betas = check_betas(betas) if betas is not None else None
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"method.rank={rank!r} must be a whole number >= 1 (PowerSGD's approximation rank)")
        if (error_feedback or warm_start) and start_iter < 2:
            raise ValueError(f"method.start_iter={start_iter} must be >= 2 with error feedback or warm start "
                             "(torch's PowerSGD needs two plain all-reduce steps while DDP rebuilds its buckets)")
        if not bucket_cap_mb > 0:
            raise ValueError(f"method.bucket_cap_mb={bucket_cap_mb} must be > 0 (DDP's default is 25)")
        self.rank, self.start_iter = rank, start_iter
        self.error_feedback, self.warm_start = bool(error_feedback), bool(warm_start)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.mean_grad: torch.Tensor | None = None
        self.sent: list[torch.Tensor] = []

    def make_optimizer(self, params):
        betas = {"betas": self.betas} if self.betas is not None else {}
        if self.optimizer == "lion":
            return Lion(params, lr=self.lr, weight_decay=self.weight_decay, **betas)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay, **betas)

    def comm_hook(self, seed: int, module: torch.nn.Module) -> tuple[Any, Any]:
        """(state, hook) for `DistributedDataParallel.register_comm_hook` on `module`."""
        del module  # torch's hooks need nothing of it
        if self.compression == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=self.rank, start_powerSGD_iter=self.start_iter,
                use_error_feedback=self.error_feedback, warm_start=self.warm_start, random_seed=seed)
            return state, powerSGD_hook.powerSGD_hook
        hooks = {"none": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook,
                 "fp16": default_hooks.fp16_compress_hook}
        return None, hooks[self.compression]

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        # The gradient is already the mean (the hooks ran in backward); the message is what they sent.
        self.mean_grad = grad
        return Message({f"payload{i}": t for i, t in enumerate(self.sent)})

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        return messages[0]  # an all-reduce: every worker receives a payload of the size it sent

    def decode(self, down: Message, ctx: StepContext) -> torch.Tensor:
        return self.mean_grad

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.torch_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.torch_optimizer.load_state_dict(state["optimizer"])

    def resume_gap(self) -> str | None:
        # Its error feedback and warm-start factors are keyed by DDP's bucket index, and a restarted DDP
        # rebuilds its buckets after its first step, so that state cannot be carried over a restart.
        if self.compression == "powersgd":
            return ("torch's PowerSGD hook state (error feedback, warm-start factors, its step count) is not in the "
                    f"checkpoint: the hook starts over ({self.start_iter} plain all-reduce steps, zero error)")
        return None


register(MethodInfo("ddp", DDPMethod, "DDP AdamW (fp32)", "global", "32", "32", order=2,
                    fixed={"compression": "none"}, reference="torch DistributedDataParallel",
                    summary="AdamW on DDP's fp32 all-reduce, overlapped with backward; `cluster=torchdist` only"))
register(MethodInfo("ddp_lion", DDPMethod, "DDP Lion (fp32)", "global", "32", "32", order=3,
                    fixed={"compression": "none", "optimizer": "lion"}, reference="torch DistributedDataParallel",
                    summary="`timm.optim.Lion` on DDP's fp32 all-reduce: G-Lion as users run it; "
                            "`cluster=torchdist` only"))
register(MethodInfo("ddp_bf16", DDPMethod, "DDP AdamW (bf16)", "quantized", "16", "16", order=4,
                    fixed={"compression": "bf16"}, reference="torch ddp_comm_hooks.bf16_compress_hook",
                    summary="AdamW on DDP's bf16-compressed all-reduce (its comm hook); `cluster=torchdist` only"))
register(MethodInfo("ddp_fp16", DDPMethod, "DDP AdamW (fp16)", "quantized", "16", "16", order=5,
                    fixed={"compression": "fp16"}, reference="torch ddp_comm_hooks.fp16_compress_hook",
                    summary="AdamW on DDP's fp16-compressed all-reduce (its comm hook); `cluster=torchdist` only"))
register(MethodInfo("powersgd", DDPMethod, "PowerSGD AdamW", "quantized", "32*(pq + n_dense)/n", "32*(pq + n_dense)/n",
                    order=6, fixed={"compression": "powersgd"}, reference="Vogels et al. 2019; torch powerSGD_hook",
                    summary="AdamW on torch's PowerSGD hook (rank r, error feedback, warm start; plain fp32 for "
                            "its first `start_iter` steps); `cluster=torchdist` only"))
