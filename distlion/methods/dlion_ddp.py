"""D-Lion as a `DistributedDataParallel` comm hook: DDP's own buckets, its overlap with backward.

    model = DistributedDataParallel(model)
    model.register_comm_hook(DLionHook(model), ddp_hook)        # this rank's momenta live in the hook
    optimizer = VoteStep(model.parameters(), lr=1e-4, weight_decay=0.1)

As each bucket's gradients become ready in backward, the hook runs D-Lion's worker rule on them with
this rank's own momentum, exchanges the packed signs (the sharded all-to-all + all-gather of
`distlion.comm.exchange`) and hands DDP the vote Delta (+-1 for MaVo, the mean of the signs for Avg)
as the bucket's gradient; `VoteStep` then applies x = x - lr * (Delta + wd * x). The next bucket's
backward runs while the packed signs are on the wire: one thread per hook does every bucket's
worker rule and collectives in bucket order, so all ranks issue them in the same order.

A bucket is DDP's, not the flat buffer of the simulated cluster, but a run ends with the same
parameters bit for bit: every coordinate's rule is elementwise, and the "alternate" ties (+1 where
the coordinate's index + step is even) use its index in the model's flat buffer (`FlatParams`' order):
a bucket whose parameters do not keep that parity is exchanged from a copy with a pad element
before each parameter that needs one.

Every parameter must get a gradient at every step (DDP's own rule without `find_unused_parameters`);
a NaN or inf gradient raises `NonFiniteGradient`. Save `hook.state_dict()` per rank with the
optimizer's: the momenta differ by rank.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from distlion.comm.collectives import Collectives
from distlion.comm.exchange import sharded_exchange
from distlion.comm.message import Message
from distlion.methods.base import StepContext
from distlion.methods.dlion import DLion
from distlion.methods.registry import MethodInfo, register
from distlion.methods.step import NonFiniteGradient


def flat_offsets(module: nn.Module) -> dict[int, tuple[str, int]]:
    """{id(parameter): (name, its offset in its dtype's flat buffer)}, in `distlion.flat.FlatParams`' order."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        module = module.module
    offsets, ends = {}, {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            start = ends.get(p.dtype, 0)
            offsets[id(p)] = (name, start)
            ends[p.dtype] = start + p.numel()
    return offsets


class _Bucket:
    """One DDP bucket's working layout: its parameters in bucket order, each at an offset of the parity of
    its flat-buffer offset; the momenta of this rank as one buffer of that layout; the rule bound to it."""

    def __init__(self, params: list[torch.Tensor], where: dict[int, tuple[str, int]], rule: DLion, world: int,
                 momenta: dict[str, torch.Tensor]):
        self.ids = [id(p) for p in params]
        self.names = [where[id(p)][0] for p in params]
        self.sizes = [p.numel() for p in params]
        self.starts, offset = [], 0
        for p in params:
            offset += (offset - where[id(p)][1]) % 2  # a pad element where the parity differs
            self.starts.append(offset)
            offset += p.numel()
        self.numel = offset
        self.padded = offset != sum(self.sizes)
        dtype, device = params[0].dtype, params[0].device
        self.momentum = torch.zeros(offset, dtype=dtype, device=device)
        for name, start, size, p in zip(self.names, self.starts, self.sizes, params, strict=True):
            view = self.momentum[start : start + size]
            if name in momenta:  # DDP rebuilt its buckets: carry the momenta over
                view.copy_(momenta[name].reshape(-1))
            momenta[name] = view.view_as(p)
        self.rule = DLion(1.0, rule.betas, 0.0, rule.aggregation, rule.zero_sign, rule.mavo_tie)
        self.rule.bind(torch.empty(offset, dtype=dtype, device=device), world)
        if self.padded:
            self.work = torch.zeros(offset, dtype=dtype, device=device)

    def segments(self) -> Iterable[tuple[int, int, int]]:
        """(offset in the DDP bucket, offset in the working layout, size) per parameter."""
        offset = 0
        for start, size in zip(self.starts, self.sizes, strict=True):
            yield offset, start, size
            offset += size


class DLionHook:
    """The state of `ddp_hook` on one rank: its momenta, the step, the collectives, the exchange thread.

    `module` is the model (or its DDP wrapper) whose parameters DDP buckets; the other settings are
    `DLion`'s. `records` collects, per bucket exchanged, the (uplink, downlink) messages as built (for the
    bits); `wire` counts the bytes this rank's collectives moved.
    """

    def __init__(self, module: nn.Module, betas: tuple[float, float] = (0.9, 0.99), aggregation: str = "mavo",
                 zero_sign: str = "alternate", mavo_tie: str = "alternate",
                 process_group: dist.ProcessGroup | None = None):
        self.rule = DLion(1.0, betas, 0.0, aggregation, zero_sign, mavo_tie)  # validates the settings
        self.where = flat_offsets(module)
        self.process_group = process_group
        self.momenta: dict[str, torch.Tensor] = {}
        self.step = 0
        self.records: list[tuple[Message, Message]] = []
        self._buckets: dict[int, _Bucket] = {}
        self._comm: Collectives | None = None
        self._jobs: queue.Queue | None = None

    @property
    def comm(self) -> Collectives:
        if self._comm is None:
            self._comm = Collectives(self.process_group)
        return self._comm

    @property
    def wire(self):
        return self.comm.wire

    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Queue the bucket's exchange on the hook's thread; the future holds Delta in the bucket's layout."""
        params = list(bucket.parameters())
        plan = self._buckets.get(bucket.index())
        if plan is None or plan.ids != [id(p) for p in params]:
            unknown = [p for p in params if id(p) not in self.where]
            if unknown:
                raise ValueError("DLionHook: DDP bucketed a parameter that is not among the module's trainable "
                                 "parameters; build the hook from the model DDP wraps")
            plan = self._buckets[bucket.index()] = _Bucket(params, self.where, self.rule, self.comm.world_size,
                                                          self.momenta)
        future: torch.futures.Future = torch.futures.Future()
        if self._jobs is None:
            self._jobs = queue.Queue()
            threading.Thread(target=self._serve, args=(self._jobs,), name="dlion-ddp-hook", daemon=True).start()
        self._jobs.put((plan, bucket.buffer(), self.step, future))
        if bucket.is_last():
            self.step += 1
        return future

    def _serve(self, jobs: queue.Queue) -> None:
        while True:
            plan, grad, step, future = jobs.get()
            try:
                future.set_result(self._exchange(plan, grad, step))
            except Exception as err:  # noqa: BLE001 - every failure reaches DDP through the future
                future.set_exception(err)

    def _exchange(self, plan: _Bucket, grad: torch.Tensor, step: int) -> torch.Tensor:
        comm = self.comm
        work = grad
        if plan.padded:
            work = plan.work
            for bucket_at, work_at, size in plan.segments():
                work[work_at : work_at + size].copy_(grad[bucket_at : bucket_at + size])
        if not bool(torch.isfinite(work.sum())):
            bad = next(name for name, (at, _, size) in zip(plan.names, plan.segments(), strict=True)
                       if not bool(torch.isfinite(grad[at : at + size]).all()))
            raise NonFiniteGradient(f"step {step}: rank {comm.rank}'s gradient of {bad} is not finite (NaN or inf)")
        ctx = StepContext(step=step, lr=1.0, num_workers=comm.world_size, worker=comm.rank)
        up = plan.rule.worker_rule(work, {"momentum": plan.momentum}, ctx)
        down, _ = sharded_exchange(lambda received: plan.rule.server_rule(received, ctx), up, comm)
        self.records.append((up.meta(), down.meta()))
        delta = plan.rule.delta(down, ctx)
        if not plan.padded:
            return grad.copy_(delta)
        for bucket_at, work_at, size in plan.segments():
            grad[bucket_at : bucket_at + size].copy_(delta[work_at : work_at + size])
        return grad

    def state_dict(self) -> dict[str, Any]:
        """This rank's momenta (by parameter name) and the step."""
        return {"step": self.step, "momenta": {name: m.clone() for name, m in self.momenta.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        for name, saved in state["momenta"].items():
            if name in self.momenta:
                self.momenta[name].copy_(saved)
            else:
                self.momenta[name] = saved.clone()  # linked into a bucket's buffer at its first exchange


def ddp_hook(state: DLionHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradient becomes D-Lion's vote (see the module docstring)."""
    return state.submit(bucket)


# DDP checks the hook's annotations as objects, and this module's are strings (postponed evaluation).
ddp_hook.__annotations__ = {"state": DLionHook, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


class VoteStep(torch.optim.Optimizer):
    """D-Lion's apply rule on the vote that `ddp_hook` left in `.grad`: x = x - lr * (Delta + wd * x),
    with the decay decoupled as in the paper (and in `DistributedLion`), rounding as they do."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-4,
                 weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = float(group["lr"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is not None:
                    p.mul_(1 - lr * decay)
                    p.add_(p.grad, alpha=-lr)
        return loss


def _merged(messages: Iterable[Message]) -> Message:
    """One step's per-bucket messages as one (bucket i's tensor k under "bucket{i}_{k}")."""
    return Message({f"bucket{i}_{k}": t for i, m in enumerate(messages) for k, t in m.tensors.items()})


class DLionDDP(DLion):
    """D-Lion through DDP and `ddp_hook`: the same rules, exchanged bucket by bucket during backward.

    The gradient the cluster hands the step is already the vote; the step's worker and server rules only
    report the messages the hook built, and the apply rule is `VoteStep`'s.
    """

    name = "dlion_ddp"
    exchange = "in_backward"
    backends: ClassVar[tuple[str, ...]] = ("torchdist",)

    def __init__(self, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 aggregation: str = "mavo", zero_sign: str = "alternate", mavo_tie: str = "alternate",
                 bucket_cap_mb: float = 25.0):
        super().__init__(lr, betas, weight_decay, aggregation, zero_sign, mavo_tie)
        if not bucket_cap_mb > 0:
            raise ValueError(f"method.bucket_cap_mb={bucket_cap_mb} must be > 0 (DDP's default is 25)")
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.hook: DLionHook | None = None
        self._pending: dict[str, Any] | None = None

    def comm_hook(self, seed: int, module: nn.Module) -> tuple[DLionHook, Any]:
        """(state, hook) for `DistributedDataParallel.register_comm_hook`."""
        del seed  # nothing random
        self.hook = DLionHook(module, self.betas, self.aggregation, self.zero_sign, self.mavo_tie)
        if self._pending is not None:
            self.hook.load_state_dict(self._pending)
        return self.hook, ddp_hook

    def init_worker_state(self) -> dict[str, torch.Tensor]:
        return {}  # the momenta live in the hook, on their rank

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        self._delta = grad
        records, self.hook.records = self.hook.records, []
        self._down = _merged(down for _, down in records)
        return _merged(up for up, _ in records)

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        return self._down  # the hook's all-gathered votes

    def apply_rule(self, down: Message, ctx: StepContext) -> None:
        self.params.mul_(1 - ctx.lr * self.weight_decay)
        self.params.add_(self._delta, alpha=-ctx.lr)

    def state_dict(self) -> dict[str, Any]:
        return {"hook": self.hook.state_dict() if self.hook is not None else self._pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = state["hook"]
        if self.hook is not None:
            self.hook.load_state_dict(self._pending)


register(MethodInfo("dlion_ddp", DLionDDP, "D-Lion (MaVo, DDP hook)", "sign", "1 + z", "1 + z", order=14,
                    fixed={"aggregation": "mavo"}, reference="Liu et al. 2024; torch DDP comm hook",
                    summary="D-Lion MaVo as a DDP comm hook, exchanged per bucket during backward; "
                            "`cluster=torchdist` only"))
register(MethodInfo("dlion_avg_ddp", DLionDDP, "D-Lion (Avg, DDP hook)", "sign", "1 + z",
                    "ceil(log2((1 + z) * N + 1))", order=15, fixed={"aggregation": "avg"},
                    reference="Liu et al. 2024; torch DDP comm hook",
                    summary="D-Lion Avg as a DDP comm hook, exchanged per bucket during backward; "
                            "`cluster=torchdist` only"))
