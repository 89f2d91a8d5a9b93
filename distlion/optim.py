"""`DistributedLion`: Distributed Lion as a drop-in `torch.optim.Optimizer` for your own torchrun script.

It replaces DDP's gradient all-reduce: do not wrap the model in DDP (or give DDP a no-op comm hook).
Each rank backpropagates its own batch; `step()` runs the step loop of `distlion.methods.step` with
the rules of `distlion.methods.dlion.DLion` and the sharded exchange of `distlion.comm.exchange`:

    delta_i = sign(b1 m_i + (1 - b1) g_i)      packed 8 per byte, on the gradients' device
    all-to-all: rank j receives every rank's packed signs of the j-th 1/N shard
    rank j votes (MaVo) or counts (Avg) on its shard; all-gather of the shard results
    x = x - lr * (Delta + wd * x);   m_i = b2 m_i + (1 - b2) g_i  (never synchronized)

so the wire carries 1 bit up and 1 bit down per parameter for MaVo. Works on CPU tensors with gloo
and CUDA tensors with NCCL (packing and voting stay on the device), and without any process group
as a world of one, where it is Lion (timm's, up to the sign(0) tie rule).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from distlion.comm.collectives import Collectives, WireBytes
from distlion.comm.exchange import CollectiveExchange
from distlion.flat import LOW_PRECISION, Segment
from distlion.methods.base import StepContext
from distlion.methods.dlion import DLion
from distlion.methods.step import NONFINITE_POLICIES, BufferWorkers, algorithm1_step


class DistributedLion(torch.optim.Optimizer):
    """Distributed Lion over `process_group` (the default group; one process when none is initialized).

    Every rank must construct it over the same parameters in the same order. Parameters are
    exchanged per param group and per (device, dtype) as one flat buffer. `lr`, `betas` and
    `weight_decay` are read from the param groups at every step, so a learning-rate scheduler
    reaches them. `lr` may be 0, as torch's optimizers' may (a warm-up from 0): such a step moves no
    parameter and updates the momenta; a negative or non-finite one raises, naming `lr`. Momentum
    ("exp_avg") is per rank: every rank saves its own state_dict.
    `zero_sign` and `mavo_tie` are the tie rules of `DLion`. `wire` counts the bytes this rank's
    collectives moved.

    Parameters without a gradient follow torch's convention: one whose `grad` is None on every rank
    is left untouched (no decay, no tie move, no momentum update). One that has a gradient on some
    ranks only counts as a zero gradient on the others (its momentum decays there), so that every
    rank applies the same vote; the ranks agree on this with one small all-reduce of a flag per
    parameter each step.

    `nonfinite`: a NaN/inf gradient raises ("error", naming the step, rank and parameter) or skips
    the step on every rank ("skip", counted in `skipped_steps`). `master_weights=True` keeps an fp32
    copy of bf16/fp16 parameters (state "master") and steps it: a Lion-type update of 1e-4 on a bf16
    weight near 1 is below its rounding step and would be lost every step.

    A copy (`copy.deepcopy`, pickle) keeps every setting and the state; it runs over the default
    process group.

    `check_ranks`: at its first step, and at the first step after `load_state_dict`, the ranks compare a
    checksum of their gradients (and of their loaded momenta) with one small all-gather, and a step
    raises if every rank holds the same ones, since D-Lion needs each rank's own: equal gradients mean
    DDP all-reduced them underneath (its fp32 traffic, while `wire` counts 1 bit), equal loaded momenta
    mean one rank's state was loaded into all (the Hugging Face `Trainer` saves rank 0's `optimizer.pt`).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        aggregation: str = "mavo",
        process_group: dist.ProcessGroup | None = None,
        zero_sign: str = "alternate",
        mavo_tie: str = "alternate",
        nonfinite: str = "error",
        master_weights: bool = False,
        check_ranks: bool = True,
    ):
        _check_lr(lr)
        DLion(_RULE_LR, betas, weight_decay, aggregation, zero_sign, mavo_tie)  # validates the other settings
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={nonfinite!r} is unknown; choose one of {NONFINITE_POLICIES}")
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "aggregation": aggregation,
                    "zero_sign": zero_sign, "mavo_tie": mavo_tie, "nonfinite": nonfinite,
                    "master_weights": master_weights, "check_ranks": check_ranks}
        super().__init__(params, defaults)
        self.process_group = process_group
        self._init_runtime()
        low = [p.dtype for g in self.param_groups if not g["master_weights"] for p in g["params"]
               if p.dtype in LOW_PRECISION]
        if low:
            warnings.warn(f"DistributedLion: {low[0]} parameters lose updates below their rounding step (an lr of "
                          "1e-4 on a weight near 1 in bf16 is lost every step); pass master_weights=True",
                          stacklevel=2)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _check_lr(self.param_groups[-1]["lr"], len(self.param_groups) - 1)

    def _init_runtime(self) -> None:
        """What is rebuilt rather than copied: the collectives and the flat momentum buffers."""
        self._comm: Collectives | None = None
        self._momenta: dict[tuple[int, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._flats: dict[tuple[int, torch.device, torch.dtype], _FlatBucket] = {}
        self._flat_of: dict[int, _FlatBucket] = {}  # id(parameter) -> the flat buffer it lives in
        self.skipped_steps = 0
        self._unchecked = {"gradients"} if self.check_ranks else set()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's __getstate__ keeps defaults, state and param_groups; the process group handle is not copied.
        super().__setstate__(state)
        self.process_group = None
        self._init_runtime()

    @property
    def check_ranks(self) -> bool:
        return bool(self.defaults.get("check_ranks", True))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.check_ranks:
            self._unchecked.add("momenta")

    def _check_ranks_differ(self) -> None:
        """Raise if every rank holds the same gradients (or loaded momenta): see `check_ranks`."""
        checks, self._unchecked = self._unchecked, set()
        if self.comm.world_size == 1:
            return
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        momenta = [self.state[p]["exp_avg"] for p in params if "exp_avg" in self.state[p]]
        device = params[0].device

        def checksum(tensors: list[torch.Tensor]) -> torch.Tensor:  # (sum, sum of |.|) in float64
            total = torch.zeros(2, dtype=torch.float64, device=device)
            for t in tensors:
                total += torch.stack([t.double().sum(), t.double().abs().sum()])
            return total

        every = self.comm.all_gather(torch.cat([checksum(grads), checksum(momenta)]))
        same = (every == every[0]).all(dim=0)
        if "gradients" in checks and bool(same[:2].all()) and float(every[0, 1]) > 0:
            raise RuntimeError(
                "DistributedLion: every rank holds the same gradient, so something all-reduced them before the "
                "step (a model wrapped in DistributedDataParallel): D-Lion needs each rank's own. Do not wrap the "
                "model, or register DDP's no-op hook (model.register_comm_hook(None, noop_hook)), or use D-Lion's "
                "DDP hook (distlion.methods.dlion_ddp); check_ranks=False if the ranks really see the same data")
        if "momenta" in checks and bool(same[2:].all()) and float(every[0, 3]) > 0:
            raise RuntimeError(
                "DistributedLion: the state_dict loaded on every rank holds the same momenta (one rank's saved "
                "state loaded into all: the Hugging Face Trainer's optimizer.pt is rank 0's); save and load each "
                "rank's own state (distlion.hf.DistributedLionTrainer does), or pass check_ranks=False to resume "
                "from shared momenta on purpose")

    @property
    def comm(self) -> Collectives:
        """The counted collectives, made at the first step (the process group may come later)."""
        if self._comm is None:
            self._comm = Collectives(self.process_group) if dist.is_initialized() else Collectives.local()
        return self._comm

    @property
    def wire(self) -> WireBytes:
        return self.comm.wire

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):  # (a scheduler may have set any lr) before any update
            _check_lr(group["lr"], index)
        if self._unchecked:
            self._check_ranks_differ()
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            if any(p.grad is not None and p.grad.is_sparse for p in params):
                raise RuntimeError("DistributedLion does not support sparse gradients")
            every: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            used: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p, has_grad in zip(params, self._used_on_any_rank(params), strict=True):
                key = (p.device, self._working_dtype(group, p))
                every.setdefault(key, []).append(p)
                if has_grad:
                    used.setdefault(key, []).append(p)
            for key, bucket in used.items():
                if len(bucket) == len(every[key]) and all(p.dtype == key[1] for p in bucket):
                    self._step_flat(index, group, bucket)  # the common case: no copies
                else:
                    self._step_bucket(group, bucket)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradients that live in a flat buffer in place, so they stay its views (one memset per
        buffer, and the next backward accumulates into it), and marks them as None would: one that no backward
        reaches before the step is no gradient. Any other gradient as torch does."""
        in_place = set()
        for flat in self._flats.values():
            if flat.grads_linked():
                flat.grad.zero_()
                flat.zeroed.update(flat.ids)
                in_place.update(flat.ids)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or id(p) in in_place:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().requires_grad_(False).zero_()

    def _used_on_any_rank(self, params: list[torch.Tensor]) -> list[bool]:
        """Whether each parameter has a gradient on at least one rank (a MAX all-reduce of flags)."""
        if self.comm.world_size == 1:
            return [self._has_grad(p) for p in params]
        if not params:
            return []
        flags = torch.tensor([self._has_grad(p) for p in params], dtype=torch.uint8, device=params[0].device)
        return [bool(f) for f in self.comm.all_reduce(flags, op="max").tolist()]

    def _has_grad(self, p: torch.Tensor) -> bool:
        """Whether `p` has a gradient this step: None has none, and neither has a flat buffer's view that
        `zero_grad` zeroed and no backward reached since (what set_to_none would have made None)."""
        if p.grad is None:
            return False
        flat = self._flat_of.get(id(p))
        return flat is None or not (id(p) in flat.zeroed and flat.is_view(p))

    @staticmethod
    def _working_dtype(group: dict[str, Any], p: torch.Tensor) -> torch.dtype:
        return torch.float32 if group["master_weights"] and p.dtype in LOW_PRECISION else p.dtype

    def _flat_momentum(self, params: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The bucket's momenta as one flat buffer whose slices are the params' state["exp_avg"].

        Rebuilt (copying any existing momenta) at the first step and after `load_state_dict`.
        """
        key = tuple(id(p) for p in params)
        linked = self._momenta.get(key)
        if linked is not None and all(self.state[p].get("exp_avg") is m for p, m in zip(params, linked[1])):
            return linked[0]
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        flat = torch.zeros(offsets[-1], dtype=dtype, device=params[0].device)
        for p, start, stop in zip(params, offsets, offsets[1:], strict=False):
            old = self.state[p].get("exp_avg")
            if old is not None:
                flat[start:stop].copy_(old.reshape(-1))
            self.state[p]["exp_avg"] = flat[start:stop].view_as(p)
        self._momenta[key] = (flat, [self.state[p]["exp_avg"] for p in params])
        return flat

    def _weights(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """The tensor the update applies to: the fp32 master copy of a low-precision parameter, or the parameter."""
        if self._working_dtype(group, p) == p.dtype:
            return p.detach()
        state = self.state[p]
        if "master" not in state:
            state["master"] = p.detach().to(torch.float32)
        return state["master"]

    def _step_flat(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """A step on persistent flat buffers: the parameters and gradients are their views, nothing is copied."""
        key = (index, params[0].device, params[0].dtype)
        flat = self._flats.get(key)
        if flat is None or flat.ids != [id(p) for p in params]:
            if flat is not None:
                flat.unhook()
            flat = self._flats[key] = _FlatBucket(params, _layout(group, params))
            self._flat_of.update(dict.fromkeys(flat.ids, flat))
        flat.link()
        comm = self.comm
        momentum = self._flat_momentum(params, flat.x.dtype)
        step = int(self.state[params[0]].get("step", 0))
        rule = flat.rule(group, comm.world_size)
        ctx = StepContext(step=step, lr=float(group["lr"]), num_workers=comm.world_size)
        local = BufferWorkers([rule], [{"momentum": momentum}])
        bits = algorithm1_step({flat.x.dtype: local}, {flat.x.dtype: flat.grad[None]}, ctx, CollectiveExchange(comm),
                               group["nonfinite"])
        if bits.skipped:
            self.skipped_steps += 1
            return
        for p in params:
            self.state[p]["step"] = step + 1

    def _step_bucket(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        comm = self.comm
        weights = [self._weights(group, p) for p in params]
        dtype = weights[0].dtype
        momentum = self._flat_momentum(params, dtype)
        step = int(self.state[params[0]].get("step", 0))
        x = torch.cat([w.reshape(-1) for w in weights])
        grad = torch.cat([(torch.zeros_like(w) if p.grad is None else p.grad.to(dtype)).reshape(-1)
                          for p, w in zip(params, weights, strict=True)])
        layout = _layout(group, params)
        rule = DLion(_RULE_LR, group["betas"], group["weight_decay"], group["aggregation"],
                     group["zero_sign"], group["mavo_tie"]).bind(x, comm.world_size, layout)
        ctx = StepContext(step=step, lr=float(group["lr"]), num_workers=comm.world_size)
        local = BufferWorkers([rule], [{"momentum": momentum}])
        bits = algorithm1_step({dtype: local}, {dtype: grad[None]}, ctx, CollectiveExchange(comm), group["nonfinite"])
        if bits.skipped:
            self.skipped_steps += 1
            return
        for p, new in zip(params, x.split([p.numel() for p in params]), strict=True):
            if "master" in self.state[p]:  # (a flat buffer's parameter is updated in place, as its view)
                self.state[p]["master"].copy_(new.view_as(p))
            p.copy_(new.view_as(p))  # rounds to a low-precision parameter's dtype
            self.state[p]["step"] = step + 1


# The lr a step's DLion rule is built with. The rule never reads it: each step passes the group's lr in its
# StepContext, which may be 0 here, while DLion, as a config's method, refuses an lr that trains nothing.
_RULE_LR = 1.0


def _check_lr(lr: Any, group: int | None = None) -> None:
    """An lr of 0 moves nothing, as in torch's optimizers (a warm-up's first step); a negative or non-finite one
    is a mistake. Named `lr`, as the caller passed it (not `method.lr`, a config's setting)."""
    value = float(lr)
    if not (math.isfinite(value) and value >= 0):  # (NaN fails both)
        where = "" if group is None else f" of param group {group}"
        raise ValueError(f"DistributedLion: lr={value}{where} must be finite and >= 0 (0 moves no parameter)")


def _layout(group: dict[str, Any], params: list[torch.Tensor]) -> list[Segment]:
    """The parameters back to back in one flat buffer, named for error messages by their place in the group."""
    place = {id(q): i for i, q in enumerate(group["params"])}
    layout, offset = [], 0
    for p in params:
        layout.append(Segment(f"parameter {place[id(p)]} of its param group", offset, p.numel(), tuple(p.shape)))
        offset += p.numel()
    return layout


class _FlatBucket:
    """One param group's parameters of one device and dtype, re-homed into a flat buffer `x` whose slices they
    are, with their gradients as slices of `grad`: a step reads and writes the buffers, with no copies.

    Every parameter of the bucket has a gradient on some rank at such a step (else the step copies, as
    `_step_bucket` does). `zeroed` holds the parameters whose gradient `zero_grad` zeroed in place and no
    backward has accumulated into since (a post-accumulate-grad hook takes them out): they have none.
    """

    def __init__(self, params: list[torch.Tensor], layout: list[Segment]):
        self.params = params
        self.ids = [id(p) for p in params]
        self.layout = layout
        self.slots = {id(p): (s.offset, s.numel) for p, s in zip(params, layout, strict=True)}
        device, dtype, numel = params[0].device, params[0].dtype, layout[-1].stop
        self.x = torch.empty(numel, dtype=dtype, device=device)
        self.grad = torch.zeros(numel, dtype=dtype, device=device)
        self.zeroed: set[int] = set()
        self._hooks = [p.register_post_accumulate_grad_hook(self._reached) for p in params]
        # What link() made: each gradient's view (the same Python object while it stays p.grad) and each
        # parameter's address, so that a step checks them by identity, not by slicing the buffers.
        self._index = {id(p): i for i, p in enumerate(params)}
        self._grad_views: list[torch.Tensor | None] = [None] * len(params)
        self._addresses: list[int] = []
        self._rule: DLion | None = None
        self._settings: tuple | None = None

    def _reached(self, p: torch.Tensor) -> None:
        self.zeroed.discard(id(p))

    def unhook(self) -> None:
        """Remove the gradient hooks (the bucket is replaced by one over other parameters)."""
        for hook in self._hooks:
            hook.remove()

    def is_view(self, p: torch.Tensor) -> bool:
        return p.grad is not None and p.grad is self._grad_views[self._index[id(p)]]

    def grads_linked(self) -> bool:
        return all(p.grad is not None and p.grad is v for p, v in zip(self.params, self._grad_views, strict=True))

    def link(self) -> None:
        """Make every parameter a view of `x` and every gradient a view of `grad` (copying what is elsewhere)."""
        if self.grads_linked() and [p.data_ptr() for p in self.params] == self._addresses:
            return
        for i, p in enumerate(self.params):
            start, numel = self.slots[id(p)]
            if p.data_ptr() != self.x[start:].data_ptr() or not p.is_contiguous():
                self.x[start : start + numel].copy_(p.detach().reshape(-1))
                p.data = self.x[start : start + numel].view_as(p)
            if not self.is_view(p):
                view = self.grad[start : start + numel]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad.reshape(-1))
                p.grad = view.view_as(p)
                self._grad_views[i] = p.grad
        self._addresses = [p.data_ptr() for p in self.params]

    def rule(self, group: dict[str, Any], world_size: int) -> DLion:
        """The D-Lion rule bound to `x`, rebuilt only when a setting changed (lr comes with each step)."""
        settings = (tuple(group["betas"]), group["weight_decay"], group["aggregation"], group["zero_sign"],
                    group["mavo_tie"], world_size)
        if settings != self._settings:
            self._rule = DLion(_RULE_LR, *settings[:-1]).bind(self.x, world_size, self.layout)
            self._settings = settings
        return self._rule
