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
from dataclasses import dataclass

import torch

from distlion.comm.collectives import WireBytes
from distlion.comm.exchange import Exchanger
from distlion.comm.message import Message
from distlion.methods.base import Method, StepContext


@dataclass
class StepBits:
    """Bits moved in one step, counted from the messages built: each worker's uplink, and the downlink
    each worker receives. `wire` is what this process's collectives moved (None in one process)."""

    up: list[int]
    down: int
    wire: WireBytes | None = None

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


def algorithm1_step(
    buffers: dict[torch.dtype, BufferWorkers],
    grads: dict[torch.dtype, torch.Tensor],
    ctx: StepContext,
    exchanger: Exchanger,
) -> StepBits:
    """One step of Algorithm 1 given the local workers' flat gradients ({dtype: [local, numel]}), in the
    order of `exchanger.local_workers`; returns the bits of the messages built."""
    up, down = [0] * exchanger.num_workers, 0
    workers = [dataclasses.replace(ctx, worker=w) for w in exchanger.local_workers]

    def exchange(how: str, rule, messages: list[Message]) -> Message:
        nonlocal down
        reply, up_bits = exchanger.exchange(how, lambda received: rule(received, ctx), messages)
        for i, bits in enumerate(up_bits):
            up[i] += bits
        down += reply.bits
        return reply

    for dtype, local in buffers.items():
        server = local.methods[0]
        rules = list(zip(local.methods, grads[dtype], local.states, workers, strict=True))
        if server.pre_exchange is not None:
            reply = exchange(server.pre_exchange, server.pre_server_rule, [m.pre_worker_rule(*r) for m, *r in rules])
            for method in local.appliers:
                method.pre_apply_rule(reply, ctx)
        reply = exchange(server.exchange, server.server_rule, [m.worker_rule(*r) for m, *r in rules])
        for method in local.appliers:
            method.apply_rule(reply, ctx)
    return StepBits(up, down)
