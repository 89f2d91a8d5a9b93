"""Algorithm 1 of the paper, written once: one step of any method, whoever runs it.

Per flat buffer:

    [pre-exchange]  pre_worker_rule per local worker -> exchange -> pre_apply_rule   (TernGrad's scalers)
    worker rules    worker_rule(g_i, state_i) per local worker -> uplink messages
    exchange        the server rule over all N uplinks -> the downlink every worker holds
    apply           apply_rule(downlink) on the parameters

The exchange is the caller's (`distlion.comm.exchange.Exchanger`): all N workers in one process
(`InProcessExchange`), or one worker per rank over counted collectives (`CollectiveExchange`). The
cluster backends (`distlion.cluster`) and the `DistributedLion` optimizer both step with this
function, and methods never learn which of them runs their rules.

Parameters: a `BufferWorkers` holds, for each local worker, the method instance it runs its rules
on. With one shared parameter copy (every synchronous method: all workers apply the same downlink)
all entries are the same instance, bound to that copy, and the apply runs once; a backend that keeps
a model replica per worker binds one instance per replica and the apply runs on each.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from distlion.comm.collectives import WireBytes
from distlion.comm.exchange import Exchanger
from distlion.comm.faults import Faults
from distlion.comm.message import Message
from distlion.methods.base import Method, StepContext


@dataclass
class StepBits:
    """Bits moved in one step, counted from the messages built: each worker's uplink, and the downlink
    each worker receives. `wire` is what this process's collectives moved (None in one process)."""

    up: list[int]
    down: int
    wire: WireBytes | None = None
    skipped: bool = False
    """The step was skipped: a worker's gradient was not finite (`nonfinite="skip"`)."""
    times: dict[str, float] = field(default_factory=dict)
    """Seconds this process spent in each phase of the step (`PHASES`)."""
    exchanged: dict[torch.dtype, tuple[list[Message], Message]] = field(default_factory=dict)
    """Per buffer, the messages this process sent and the downlink, kept when asked (`diagnose`) for diagnostics
    computed after the step's timing."""

    @property
    def mean_up(self) -> float:
        """Uplink bits of the average worker."""
        return sum(self.up) / len(self.up)

    @property
    def per_worker(self) -> float:
        """Bits one (average) worker sends and receives: the paper's per-iteration count, x n parameters."""
        return self.mean_up + self.down

    @property
    def total(self) -> int:
        """All bits that crossed the network: N uplinks + N copies of the downlink."""
        return sum(self.up) + self.down * len(self.up)


@dataclass
class BufferWorkers:
    """One flat buffer's local workers: the method instance each runs on, and each one's own state."""

    methods: list[Method]
    states: list[dict[str, torch.Tensor]]

    @property
    def appliers(self) -> list[Method]:
        """The distinct instances, one per parameter copy."""
        return list({id(m): m for m in self.methods}.values())


NONFINITE_POLICIES = ("error", "skip")

#: The phases of a step this process times: the worker rules (and the finiteness check), the exchanges
#: (their collectives; in one process the server rule), the apply rules. The gradient computation before
#: the step is the caller's "compute".
PHASES = ("encode", "comm", "apply")


class PhaseTimer:
    """Wall seconds per phase; waits for the device's queued work at each boundary, so a GPU phase is timed
    where it runs rather than where it was queued."""

    def __init__(self, device: torch.device, phases: tuple[str, ...] = PHASES):
        self.device = device
        self.times = dict.fromkeys(phases, 0.0)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start


class NonFiniteGradient(FloatingPointError):
    """A worker's gradient holds a NaN or an infinity."""


def nonfinite_workers(buffers: dict[torch.dtype, BufferWorkers], grads: dict[torch.dtype, torch.Tensor],
                      local_workers: list[int]) -> dict[int, str]:
    """{worker: the first parameter whose gradient is NaN or inf} for the local workers that have one.

    One pass over all local gradients: a non-finite entry makes its worker's sum non-finite; a finite sum
    that overflowed is told apart by the (rarely needed) exact check."""
    bad = {}
    for dtype, local in buffers.items():
        g = grads[dtype]
        sums_finite = torch.isfinite(g.sum(dim=1)).tolist()  # one reduction and one sync for every worker
        for worker, row, finite in zip(local_workers, g, sums_finite, strict=True):
            if finite or worker in bad or all(bool(torch.isfinite(v)) for v in torch.aminmax(row)):
                continue
            first = int((~torch.isfinite(row)).nonzero()[0])
            bad[worker] = next(s.name for s in local.methods[0].layout if s.offset <= first < s.stop)
    return bad


def algorithm1_step(
    buffers: dict[torch.dtype, BufferWorkers],
    grads: dict[torch.dtype, torch.Tensor],
    ctx: StepContext,
    exchanger: Exchanger,
    nonfinite: str = "error",
    faults: Faults | None = None,
    diagnose: bool = False,
) -> StepBits:
    """One step of Algorithm 1 given the local workers' flat gradients ({dtype: [local, numel]}), in the
    order of `exchanger.local_workers`; returns the bits of the messages built.

    A gradient with a NaN or inf never reaches a worker rule (it would poison that worker's momentum
    for good). `nonfinite="error"` raises `NonFiniteGradient` naming the step, worker and parameter
    (under torch.distributed the other ranks then fail at their next collective); `"skip"` skips the
    step on every worker, as AMP's loss scaler does: no momentum and no parameter changes, and every
    rank agrees through one all-gather of a flag per worker.

    `faults` (`distlion.comm.faults`) rewrites the step's uplinks of the faulty local workers before the exchange.
    `diagnose`: keep the messages sent and the downlink of each buffer's exchange in `StepBits.exchanged`.
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r} is unknown; choose one of {NONFINITE_POLICIES}")
    timer = PhaseTimer(next(iter(grads.values())).device)
    with timer.phase("encode"):
        bad = nonfinite_workers(buffers, grads, exchanger.local_workers)
    if bad and nonfinite == "error":
        worker, name = next(iter(bad.items()))
        raise NonFiniteGradient(
            f"step {ctx.step}: worker {worker}'s gradient of {name} is not finite (NaN or inf); lower the learning "
            "rate, check the data, or skip such steps (train.nonfinite=skip; nonfinite=\"skip\" in Python)"
        )
    if nonfinite == "skip":
        with timer.phase("comm"):
            skip = any(exchanger.agree([w in bad for w in exchanger.local_workers]))
        if skip:
            return StepBits([0] * exchanger.num_workers, 0, skipped=True, times=timer.times)
    up, down = [0] * exchanger.num_workers, 0
    workers = [dataclasses.replace(ctx, worker=w) for w in exchanger.local_workers]

    def exchange(how: str, rule, messages: list[Message]) -> Message:
        nonlocal down
        with timer.phase("comm"):
            reply, up_bits = exchanger.exchange(how, lambda received: rule(received, ctx), messages)
        for i, bits in enumerate(up_bits):
            up[i] += bits
        down += reply.bits
        return reply

    def exchange_round(local: BufferWorkers, rules: list, how: str, worker_rule, server_rule, apply_rule,
                       corrupt=None) -> tuple[list[Message], Message]:
        """Worker rules, the exchange and the apply rules of one round (the pre-exchange's or the step's); the
        messages sent and the downlink."""
        with timer.phase("encode"):
            messages = [worker_rule(m)(*r) for m, *r in rules]
            if corrupt is not None:
                messages = corrupt(messages)
        reply = exchange(how, server_rule, messages)
        with timer.phase("apply"):
            for method in local.appliers:
                apply_rule(method)(reply, ctx)
        return messages, reply

    exchanged: dict[torch.dtype, tuple[list[Message], Message]] = {}

    for dtype, local in buffers.items():
        server = local.methods[0]
        rules = list(zip(local.methods, grads[dtype], local.states, workers, strict=True))
        if server.pre_exchange is not None:
            exchange_round(local, rules, server.pre_exchange, lambda m: m.pre_worker_rule, server.pre_server_rule,
                           lambda m: m.pre_apply_rule)
        corrupt = None if faults is None else functools.partial(
            faults.corrupt, workers=exchanger.local_workers, step=ctx.step, buffer=str(dtype))
        sent, reply = exchange_round(local, rules, server.exchange, lambda m: m.worker_rule, server.server_rule,
                                     lambda m: m.apply_rule, corrupt)
        if diagnose:
            exchanged[dtype] = (sent, reply)
    return StepBits(up, down, times=timer.times, exchanged=exchanged)
