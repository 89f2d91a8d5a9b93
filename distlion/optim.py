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

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from distlion.comm.collectives import Collectives, WireBytes
from distlion.comm.exchange import CollectiveExchange
from distlion.methods.base import StepContext
from distlion.methods.dlion import DLion
from distlion.methods.step import BufferWorkers, algorithm1_step


class DistributedLion(torch.optim.Optimizer):
    """Distributed Lion over `process_group` (the default group; one process when none is initialized).

    Every rank must construct it over the same parameters in the same order. Parameters are
    exchanged per param group and per (device, dtype) as one flat buffer; a parameter without a
    gradient on this rank counts as a zero gradient, so every rank sends the same number of bits.
    `lr`, `betas` and `weight_decay` are read from the param groups at every step, so a learning-rate
    scheduler reaches them. Momentum ("exp_avg") is per rank: every rank saves its own state_dict.
    `zero_sign` and `mavo_tie` are the tie rules of `DLion`. `wire` counts the bytes this rank's
    collectives moved.
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
    ):
        # DLion validates the settings; one instance per bucket is rebound at every step.
        self._rule = DLion(lr, betas, weight_decay, aggregation, zero_sign, mavo_tie)
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})
        self.aggregation = aggregation
        self.process_group = process_group
        self._comm: Collectives | None = None
        self._momenta: dict[tuple[int, ...], torch.Tensor] = {}

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
        for group in self.param_groups:
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.requires_grad:
                    buckets.setdefault((p.device, p.dtype), []).append(p)
            for params in buckets.values():
                self._step_bucket(group, params)
        return loss

    def _flat_momentum(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The bucket's momenta as one flat buffer whose slices are the params' state["exp_avg"].

        Rebuilt (copying any existing momenta) at the first step and after `load_state_dict`.
        """
        key = tuple(id(p) for p in params)
        flat = self._momenta.get(key)
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        linked = flat is not None and all(
            "exp_avg" in self.state[p] and self.state[p]["exp_avg"].data_ptr() == flat[start:].data_ptr()
            for p, start in zip(params, offsets, strict=False)
        )
        if not linked:
            flat = torch.zeros(offsets[-1], dtype=params[0].dtype, device=params[0].device)
            for p, start, stop in zip(params, offsets, offsets[1:], strict=False):
                old = self.state[p].get("exp_avg")
                if old is not None:
                    flat[start:stop].copy_(old.reshape(-1))
                self.state[p]["exp_avg"] = flat[start:stop].view_as(p)
            self._momenta[key] = flat
        return flat

    def _step_bucket(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            raise RuntimeError("DistributedLion does not support sparse gradients")
        comm = self.comm
        momentum = self._flat_momentum(params)
        first = self.state[params[0]]
        step = int(first.get("step", 0))
        x = torch.cat([p.detach().reshape(-1) for p in params])
        grad = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params])
        rule = self._rule
        rule.betas = tuple(float(b) for b in group["betas"])
        rule.weight_decay = float(group["weight_decay"])
        rule.bind(x, comm.world_size)
        ctx = StepContext(step=step, lr=float(group["lr"]), num_workers=comm.world_size)
        local = BufferWorkers([rule], [{"momentum": momentum}])
        algorithm1_step({x.dtype: local}, {x.dtype: grad[None]}, ctx, CollectiveExchange(comm))
        for p, new in zip(params, x.split([p.numel() for p in params]), strict=True):
            p.copy_(new.view_as(p))
        rule.params = None  # no reference to the step's temporary buffer
        for p in params:
            self.state[p]["step"] = step + 1
