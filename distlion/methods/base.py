"""What a communication method is: a worker rule, a server rule and an apply rule.

Data flows one way: per-worker gradient -> worker rule -> uplink `Message` -> server rule ->
downlink `Message` -> apply rule on the shared parameters. A method instance is bound to one flat
parameter buffer (see `distlion.flat`); per-worker state (e.g. Lion momentum) is passed in
explicitly, so a cluster backend decides where it lives. State that every worker holds identically
(the global optimizers' moments) belongs to the bound method itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from distlion.comm.message import Message
from distlion.flat import Layout, Segment
from distlion.seeding import derive_seed


@dataclass(frozen=True)
class StepContext:
    """Everything a rule may need to know about the current step besides tensors."""

    step: int
    lr: float
    num_workers: int
    epoch: float = 0.0
    worker: int = 0
    seed: int = 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The random stream of worker `worker` at step `step`, seeded from (seed, step, worker) alone,
        so any backend (one process or N) draws the same bits."""
        return torch.Generator(device=device).manual_seed(derive_seed(self.seed, self.step, self.worker))


class Method(ABC):
    """Base class of every communication method. Subclasses set `name` and the three rules."""

    name: ClassVar[str]
    # How a multi-process backend runs `server_rule` (distlion.cluster.torchdist): "allgather" (every
    # rank gathers all N uplinks and runs it; valid for any rule), "sharded" (the rule is bytewise
    # along the last dim of packed uint8 messages, so rank j runs it on the j-th 1/N byte shard) or
    # "mean" (the rule depends on the uplinks only through their mean: an all-reduce).
    exchange: ClassVar[str] = "allgather"

    def __init__(self, lr: float, weight_decay: float = 0.0):
        if not lr > 0:
            raise ValueError(f"method.lr={lr} must be > 0; set method.lr to a positive learning rate")
        if weight_decay < 0:
            raise ValueError(f"method.weight_decay={weight_decay} must be >= 0")
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.params: torch.Tensor | None = None
        self.layout: Layout = []
        self.num_workers = 0

    def bind(self, params: torch.Tensor, num_workers: int, layout: Layout | None = None) -> Method:
        """Attach the method to a flat parameter buffer shared by (identical on) all workers."""
        if num_workers < 1:
            raise ValueError(f"cluster.workers={num_workers} must be >= 1")
        self.params = params
        self.num_workers = num_workers
        self.layout = layout if layout is not None else [Segment("params", 0, params.numel(), (params.numel(),))]
        return self

    def check_run(self, total_epochs: float) -> None:
        """Reject settings that cannot fit the run (e.g. a warm-up longer than the run)."""

    def init_worker_state(self) -> dict[str, torch.Tensor]:
        """Fresh per-worker state (never synchronized across workers)."""
        return {}

    @abstractmethod
    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        """Worker i: its flat gradient and state -> the uplink message (state is updated in place)."""

    @abstractmethod
    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        """Server: the N uplink messages -> the downlink message broadcast to every worker."""

    @abstractmethod
    def apply_rule(self, down: Message, ctx: StepContext) -> None:
        """Every worker: apply the downlink message to the flat parameters in place."""

    def state_dict(self) -> dict[str, Any]:
        """Replicated apply-side state, for checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def hparams(self) -> dict[str, Any]:
        return {"lr": self.lr, "weight_decay": self.weight_decay}
