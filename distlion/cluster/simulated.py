"""N workers in one process: one model replica, N worker states, one server.

Every worker applies the same downlink message to the same parameters, so a single shared copy of x
is exact; only what differs by worker (its gradient and its state, e.g. Lion momentum) is kept N
times. The step runs the method's rules in the order of the paper's Algorithm 1 and returns the
bits of the messages it built.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from distlion.flat import FlatParams
from distlion.methods.base import Method, StepContext


@dataclass
class StepBits:
    """Bits moved in one step: uplink per worker, and the downlink each worker receives."""

    up: list[int]
    down: int

    @property
    def total(self) -> int:
        """All bits that crossed the network this step (N uplinks + N copies of the downlink)."""
        return sum(self.up) + self.down * len(self.up)


class SimulatedCluster:
    """Drives one method per flat buffer (one per dtype) for `num_workers` simulated workers."""

    def __init__(self, method: Method, flat: FlatParams, num_workers: int, seed: int = 0):
        if num_workers < 1:
            raise ValueError(f"cluster.workers={num_workers} must be >= 1")
        self.flat = flat
        self.num_workers = num_workers
        self.local_workers = list(range(num_workers))
        self.is_main = True  # the process that logs and writes results
        self.seed = seed
        self.methods: dict[torch.dtype, Method] = {}
        self.worker_states: dict[torch.dtype, list[dict[str, torch.Tensor]]] = {}
        for dtype, buffer in flat.buffers.items():
            bound = copy.deepcopy(method).bind(buffer, num_workers, flat.layouts[dtype])
            self.methods[dtype] = bound
            self.worker_states[dtype] = [bound.init_worker_state() for _ in range(num_workers)]

    def step(self, grads: dict[torch.dtype, torch.Tensor], step: int, lr: float, epoch: float = 0.0) -> StepBits:
        """Apply one step given each worker's flat gradients ({dtype: [N, numel]})."""
        up = [0] * self.num_workers
        down = 0
        for dtype, method in self.methods.items():
            ctx = StepContext(step=step, lr=lr, num_workers=self.num_workers, epoch=epoch, seed=self.seed)
            if hasattr(method, "prepare"):
                # A pre-exchange round (TernGrad's shared scalers): its bits count as well.
                pre_up, pre_down = method.prepare(grads[dtype], ctx)
                for i, message in enumerate(pre_up):
                    up[i] += message.bits
                down += pre_down.bits
            messages = []
            for i, state in enumerate(self.worker_states[dtype]):
                worker_ctx = StepContext(**{**ctx.__dict__, "worker": i})
                messages.append(method.worker_rule(grads[dtype][i], state, worker_ctx))
                up[i] += messages[-1].bits
            reply = method.server_rule(messages, ctx)
            down += reply.bits
            method.apply_rule(reply, ctx)
        return StepBits(up, down)

    def mean_loss(self, losses: torch.Tensor) -> float:
        """Mean train loss over all workers (a multi-process backend averages across ranks)."""
        return losses.mean().item()

    def state_dict(self) -> dict[str, Any]:
        return {
            "methods": {str(d): m.state_dict() for d, m in self.methods.items()},
            "worker_states": {str(d): s for d, s in self.worker_states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for dtype, method in self.methods.items():
            method.load_state_dict(state["methods"][str(dtype)])
            self.worker_states[dtype] = state["worker_states"][str(dtype)]
