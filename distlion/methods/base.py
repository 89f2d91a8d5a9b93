"""What a communication method is: a worker rule, a server rule and an apply rule.

Data flows one way: per-worker gradient -> worker rule -> uplink `Message` -> server rule ->
downlink `Message` -> apply rule on the parameters. A method instance is bound to one flat
parameter buffer (see `distlion.flat`); per-worker state (e.g. Lion momentum) is passed in
explicitly, so a cluster backend decides where it lives. State that every worker holds identically
(the global optimizers' moments) belongs to the bound method itself.

A method never learns which backend runs it: `distlion.methods.step.algorithm1_step` calls
its rules, and `exchange` / `pre_exchange` name how the server rule may be distributed.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
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
    # The run's last step, where a method that syncs every H steps syncs as well (`train.final_sync`), so the
    # model that counts has seen every step and the bits of that sync are counted.
    final_sync: bool = False

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The random stream of worker `worker` at step `step`, seeded from (seed, step, worker) alone,
        so any backend (one process or N) draws the same bits."""
        return torch.Generator(device=device).manual_seed(derive_seed(self.seed, self.step, self.worker))


def mean_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(1/N) sum_i in worker order, fp32: the same bits in one process and on every rank."""
    return torch.stack([t.to(torch.float32) for t in tensors]).sum(0).div_(len(tensors))


def check_lr(lr: float, setting: str = "method.lr") -> None:
    if not lr > 0:  # also NaN
        raise ValueError(f"{setting}={lr} must be > 0; set {setting} to a positive learning rate")
    if not math.isfinite(lr):
        raise ValueError(f"{setting}={lr} must be finite; set {setting} to a positive learning rate")


def check_betas(betas: Any, setting: str = "method.betas") -> tuple[float, float]:
    """Two momentum coefficients, each in [0, 1)."""
    values = tuple(float(b) for b in betas)
    if len(values) != 2 or not all(0 <= b < 1 for b in values):
        raise ValueError(f"{setting}={list(betas)} must be two coefficients in [0, 1), e.g. [0.9, 0.99]")
    return values


def check_choice(setting: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"method.{setting}={value!r} is unknown; choose one of {choices}")


def check_fraction(setting: str, value: float, hint: str) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"method.{setting}={value} must be in [0, 1) ({hint})")


class Method(ABC):
    """Base class of every communication method. Subclasses set `name` and the three rules.

    A method's hyperparameters are its constructor's arguments, each stored under its own name
    (`hparams()` reads them back); the registry (`distlion.methods.registry`) declares the rest.
    """

    name: ClassVar[str]
    # How the server rule may be distributed over N processes (distlion.comm.exchange.EXCHANGES):
    # "allgather" (every rank gathers all N uplinks and runs it; valid for any rule), "sharded" (the
    # rule is bytewise along the last dim of packed uint8 messages, so rank j runs it on the j-th 1/N
    # byte shard) or "mean" (the rule depends on the uplinks only through their mean: an all-reduce).
    exchange: ClassVar[str] = "allgather"
    # A round before the worker rule (TernGrad's shared scalers): how it is exchanged, or None for
    # no pre-exchange. Then `pre_worker_rule`, `pre_server_rule` and `pre_apply_rule` run first.
    pre_exchange: ClassVar[str | None] = None
    # The cluster backends that can run it (`distlion.cluster.BACKENDS`).
    backends: ClassVar[tuple[str, ...]] = ("simulated", "torchdist")
    # Whether each worker keeps parameters of its own between exchanges (local-update methods: LocalSGD,
    # DiLoCo). Then the simulated cluster binds one instance per worker to that worker's replica, and the
    # worker rule may step it; otherwise every worker applies the same downlink to one shared copy.
    replicas: ClassVar[bool] = False

    def __init__(self, lr: float, weight_decay: float = 0.0):
        check_lr(lr)
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"method.weight_decay={weight_decay} must be finite and >= 0")
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.params: torch.Tensor | None = None
        self.layout: Layout = []
        self.num_workers = 0

    def bind(self, params: torch.Tensor, num_workers: int, layout: Layout | None = None) -> Method:
        """Attach the method to a flat parameter buffer (one per dtype) of `num_workers` workers."""
        self.params = params
        self.num_workers = num_workers
        self.layout = layout if layout is not None else [Segment("params", 0, params.numel(), (params.numel(),))]
        return self

    def check_run(self, total_epochs: float) -> None:
        """Reject settings that cannot fit the run (e.g. a warm-up longer than the run)."""

    # Optional abilities: a method that has one overrides it; the runner asks these, never `hasattr`.
    def sync_count(self, steps: int, final_sync: bool) -> int | None:
        """Methods that exchange every H steps (LocalSGD, DiLoCo): how many syncs a run of `steps` steps makes.
        None: the method exchanges at every step."""
        return None

    def vote_diagnostics(self, sent: list[Message], down: Message, num_workers: int) -> dict[str, torch.Tensor]:
        """Sign-voting methods: counts of vote agreement and margins over the exchanged messages (see
        `distlion.cluster.base.Cluster.vote_diagnostics`); empty for a method that does not vote."""
        return {}

    def init_worker_state(self) -> dict[str, torch.Tensor]:
        """Fresh per-worker state (never synchronized across workers)."""
        return {}

    def pre_worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        """Worker i's message of the pre-exchange (only called when `pre_exchange` is set)."""
        raise NotImplementedError(f"{type(self).__name__} sets pre_exchange but has no pre_worker_rule")

    def pre_server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        raise NotImplementedError(f"{type(self).__name__} sets pre_exchange but has no pre_server_rule")

    def pre_apply_rule(self, down: Message, ctx: StepContext) -> None:
        """Every worker: take in the pre-exchange's result before its worker rule."""
        raise NotImplementedError(f"{type(self).__name__} sets pre_exchange but has no pre_apply_rule")

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

    def resume_gap(self) -> str | None:
        """Why a run resumed from a checkpoint cannot continue exactly as the uninterrupted one (state that lives
        outside this project's reach), or None: every method here resumes bitwise."""
        return None

    def counted_params(self, gather_replicas: Callable[[], list[torch.Tensor]]) -> torch.Tensor:
        """The parameters that count (evaluated, saved, digested) for a method with replicas, given a function
        that returns every worker's replica in worker order: by default their mean."""
        return mean_in_order(gather_replicas())

    def hparams(self) -> dict[str, Any]:
        """The constructor's arguments as this instance holds them."""
        names = [k for k in inspect.signature(type(self).__init__).parameters if k != "self"]
        return {k: getattr(self, k) for k in names}
