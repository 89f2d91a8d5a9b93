"""One worker per torchrun rank: the cluster backend over torch.distributed (gloo on CPU).

    torchrun --nproc-per-node 4 -m distlion.train cluster=torchdist task=digits method=dlion

Rank r is worker r of Algorithm 1: it computes the gradient of its own batch, keeps its own worker
state (Lion momentum never leaves the rank), and holds the same parameters as every other rank.
No rank is the server. Its rule runs where the method's `exchange` says it can (`Method.exchange`),
through the counted collectives of `distlion.comm.collectives`:

  sharded    The server rule works bytewise along the last dim of packed uint8 messages (D-Lion's
             vote and sign count, TernGrad's sum of codes), so it is split: rank j serves the j-th
             of N word-aligned byte shards. All-to-all up (rank i sends peer j the packed bits of
             shard j), the rule on the shard, all-gather of the shard results down. For MaVo that
             is 1 bit up and 1 bit down per parameter, plus the padding of the last shard.
  mean       The server rule depends on the uplinks only through their mean (G-AdamW, G-Lion): an
             fp32 all-reduce, then the rule on that single mean message.
  allgather  Any server rule: every rank gathers all N uplinks (sizes may differ: DGC's and
             GradDrop's sparse values and indices) and runs the rule itself. Also TernGrad's
             pre-exchange of per-layer scalers.

`step` returns the nominal bits of the messages, the same numbers the simulated cluster counts,
plus the wire bytes this rank's collectives moved (`DistStepBits.wire`).
"""

from __future__ import annotations

import atexit
import copy
import datetime
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distlion.cluster.simulated import StepBits
from distlion.comm.collectives import CollectiveError, Collectives, WireBytes
from distlion.comm.message import Message
from distlion.flat import FlatParams
from distlion.methods.base import Method, StepContext

# Shards start on whole 64-bit words: the bit-sliced vote then works on views, and every shard starts
# at an element index that is a multiple of 64, so the alternating tie pattern keeps its parity.
SHARD_ALIGN_BYTES = 8

ServerRule = Callable[[list[Message], StepContext], Message]


def shard_bytes(num_bytes: int, world_size: int) -> int:
    """Bytes of one rank's shard of a packed plane of `num_bytes`: ceil(B / N), rounded up to words."""
    per_rank = -(-num_bytes // world_size)
    return -(-per_rank // SHARD_ALIGN_BYTES) * SHARD_ALIGN_BYTES


def _to_shards(t: torch.Tensor, shard: int, world_size: int) -> torch.Tensor:
    """Packed [..., B] -> [N, P * shard]: row j holds the j-th byte shard of each of the P planes."""
    planes = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
    padded = planes.new_zeros(planes.shape[0], world_size * shard)
    padded[:, : t.shape[-1]] = planes
    return padded.view(-1, world_size, shard).transpose(0, 1).reshape(world_size, -1)


def _split_row(row: torch.Tensor, like: dict[str, torch.Tensor], shard: int) -> dict[str, torch.Tensor]:
    """One received row of concatenated shards -> the message's tensors [..., shard] (views)."""
    out, offset = {}, 0
    for key, t in like.items():
        size = math.prod(t.shape[:-1]) * shard
        out[key] = row[offset : offset + size].view(*t.shape[:-1], shard)
        offset += size
    return out


def _from_shards(
    gathered: torch.Tensor, shards: dict[str, torch.Tensor], num_bytes: int
) -> dict[str, torch.Tensor]:
    """All-gathered shard results [N, D] -> whole tensors [..., B], the padding of the last shard cut."""
    world_size = gathered.shape[0]
    out, offset = {}, 0
    for key, t in shards.items():
        lead, shard = t.shape[:-1], t.shape[-1]
        part = gathered[:, offset : offset + t.numel()].reshape(world_size, -1, shard).transpose(0, 1)
        out[key] = part.reshape(*lead, world_size * shard)[..., :num_bytes].contiguous()
        offset += t.numel()
    return out


def sharded_exchange(
    server_rule: ServerRule, up: Message, ctx: StepContext, comm: Collectives
) -> tuple[Message, list[int]]:
    """The server rule run on 1/N byte shards (all-to-all up, all-gather down).

    Valid when the rule is bytewise along the last dim: every uplink tensor is packed uint8 [..., B]
    and every downlink tensor uint8 [..., B] (a tie pattern, if any, the same in every byte). Returns
    the downlink every rank now holds, identical to the rule on the whole messages, and the uplink
    bits of each worker.
    """
    n = comm.world_size
    lengths = {t.shape[-1] for t in up.tensors.values()}
    if len(lengths) != 1 or any(t.dtype != torch.uint8 for t in up.tensors.values()):
        shapes = {k: (tuple(t.shape), t.dtype) for k, t in up.tensors.items()}
        raise TypeError(f"a sharded exchange needs packed uint8 uplinks [..., B] of one length; got {shapes}")
    (num_bytes,) = lengths
    shard = shard_bytes(num_bytes, n)
    send = torch.cat([_to_shards(t, shard, n) for t in up.tensors.values()], dim=1)
    received = comm.all_to_all(send.reshape(-1)).view(n, -1)
    shard_down = server_rule([Message(_split_row(row, up.tensors, shard)) for row in received], ctx)
    if any(t.dtype != torch.uint8 or t.shape[-1] != shard for t in shard_down.tensors.values()):
        raise TypeError("a sharded server rule must return packed uint8 [..., shard] tensors")
    gathered = comm.all_gather(torch.cat([t.reshape(-1) for t in shard_down.tensors.values()]))
    return Message(_from_shards(gathered, shard_down.tensors, num_bytes)), [up.bits] * n


def mean_exchange(
    server_rule: ServerRule, up: Message, ctx: StepContext, comm: Collectives
) -> tuple[Message, list[int]]:
    """A server rule of the uplinks' mean: all-reduce (SUM) each tensor, divide by N, apply the rule
    to that one message. Equal to the rule on the N messages up to the order of the fp32 sums."""
    n = comm.world_size
    mean = Message({k: comm.all_reduce(t.clone()).div_(n) for k, t in up.tensors.items()})
    return server_rule([mean], ctx), [up.bits] * n


def gather_messages(message: Message, comm: Collectives) -> list[Message]:
    """Every rank's message, in rank order; shapes may differ by rank, keys and dtypes may not.

    The shapes go first (int64, one all-gather), then the payloads as bytes without padding.
    """
    keys = list(message.tensors)
    if not keys:
        return [Message() for _ in range(comm.world_size)]
    tensors = [message[k].contiguous() for k in keys]
    dims = [t.dim() for t in tensors]
    dims_of_all = [d for t in tensors for d in t.shape]
    shapes = comm.all_gather(torch.tensor(dims_of_all, dtype=torch.int64, device=tensors[0].device))
    payload = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    layouts = []
    for row in shapes.tolist():
        layout, start = [], 0
        for t, ndim in zip(tensors, dims, strict=True):
            layout.append((tuple(row[start : start + ndim]), t.dtype))
            start += ndim
        layouts.append(layout)
    numels = [sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout) for layout in layouts]
    received = comm.all_gather_uneven(payload, numels)
    messages = []
    for data, layout in zip(received, layouts, strict=True):
        tensors_j, offset = {}, 0
        for key, (shape, dtype) in zip(keys, layout, strict=True):
            size = math.prod(shape) * dtype.itemsize
            # A copy: a view at an arbitrary byte offset may not be aligned for `dtype`.
            tensors_j[key] = data[offset : offset + size].clone().view(dtype).view(shape)
            offset += size
        messages.append(Message(tensors_j))
    return messages


def gathered_exchange(
    server_rule: ServerRule, up: Message, ctx: StepContext, comm: Collectives
) -> tuple[Message, list[int]]:
    """Any server rule: all-gather the N uplinks, every rank runs the rule on all of them."""
    messages = gather_messages(up, comm)
    return server_rule(messages, ctx), [m.bits for m in messages]


EXCHANGES = {"sharded": sharded_exchange, "mean": mean_exchange, "allgather": gathered_exchange}


def init_process_group(dist_backend: str, timeout_s: float, workers: int) -> bool:
    """Join the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), with a timeout on every collective; returns whether this call created it.

    An already initialized group is reused (several runs in one process). Without torchrun's
    variables a world of one is made in memory.
    """
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            # torchrun's agent serves one store across `--max-restarts` attempts, so a restarted rank could
            # read the dead group's gloo addresses and fail to connect (torch 2.14.1): a prefix per attempt.
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
            store = dist.PrefixStore(f"distlion/attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
            dist.init_process_group(dist_backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(dist_backend, timeout=timeout)
        elif workers == 1:
            store = dist.HashStore()
            dist.init_process_group(dist_backend, store=store, rank=0, world_size=1, timeout=timeout)
        else:
            raise ValueError(
                f"cluster.backend=torchdist runs one process per worker; launch cluster.workers={workers} of "
                f"them with `torchrun --nproc-per-node {workers} -m distlion.train cluster=torchdist ...`"
            )
        created = True
    else:
        created = False
    if dist.get_world_size() != workers:
        size = dist.get_world_size()
        if created:
            dist.destroy_process_group()
        raise ValueError(
            f"cluster.workers={workers} but torchrun started {size} ranks; set cluster.workers={size} "
            "(its default is the WORLD_SIZE that torchrun sets)"
        )
    return created


@dataclass
class DistStepBits(StepBits):
    """The nominal bits of one step (as `StepBits`), and the wire bytes this rank moved for them."""

    wire: WireBytes = field(default_factory=WireBytes)


class TorchDistCluster:
    """This rank's worker: one method per flat buffer (one per dtype), its own worker state."""

    def __init__(
        self,
        method: Method,
        flat: FlatParams,
        num_workers: int,
        seed: int = 0,
        dist_backend: str = "gloo",
        timeout_s: float = 300.0,
    ):
        if num_workers < 1:
            raise ValueError(f"cluster.workers={num_workers} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"cluster.timeout_s={timeout_s} must be > 0")
        if init_process_group(dist_backend, timeout_s, num_workers):
            # Destroyed at exit rather than per run: a Hydra multirun reuses the group run after run.
            atexit.register(_destroy_process_group)
        self.comm = Collectives(timeout=datetime.timedelta(seconds=timeout_s))
        self.flat = flat
        self.num_workers = num_workers
        self.rank = self.comm.rank
        self.local_workers = [self.rank]
        self.is_main = self.rank == 0  # the rank that logs and writes results
        self.seed = seed
        self.methods: dict[torch.dtype, Method] = {}
        self.worker_states: dict[torch.dtype, dict[str, torch.Tensor]] = {}
        for dtype, buffer in flat.buffers.items():
            bound = copy.deepcopy(method).bind(buffer, num_workers, flat.layouts[dtype])
            self.methods[dtype] = bound
            self.worker_states[dtype] = bound.init_worker_state()
        self.last_wire = WireBytes()
        self._checked_step = False

    def _check_same_step(self, step: int) -> None:
        """Once per run: every rank must be at the same step (e.g. all resumed from the same checkpoint)."""
        steps = self.comm.all_gather(torch.tensor([step], dtype=torch.int64)).view(-1).tolist()
        if len(set(steps)) > 1:
            raise ValueError(
                f"the ranks start at different steps {steps} (their checkpoints disagree); "
                "delete the run directory's checkpoint.rank*.pt files to start over"
            )
        self._checked_step = True

    def step(
        self, grads: dict[torch.dtype, torch.Tensor], step: int, lr: float, epoch: float = 0.0
    ) -> DistStepBits:
        """Apply one step given this rank's flat gradients ({dtype: [1, numel]})."""
        if not self._checked_step:
            self._check_same_step(step)
        before = self.comm.wire
        up = [0] * self.num_workers
        down = 0
        for dtype, method in self.methods.items():
            ctx = StepContext(step=step, lr=lr, num_workers=self.num_workers, epoch=epoch, seed=self.seed)
            worker_ctx = StepContext(**{**ctx.__dict__, "worker": self.rank})
            grad, state = grads[dtype][0], self.worker_states[dtype]
            if hasattr(method, "pre_worker_rule"):
                # A pre-exchange round (TernGrad's shared scalers), all-gathered; its bits count too.
                pre_up = method.pre_worker_rule(grad, state, worker_ctx)
                pre_down, pre_bits = gathered_exchange(method.pre_server_rule, pre_up, ctx, self.comm)
                method.pre_apply_rule(pre_down, ctx)
                up = [a + b for a, b in zip(up, pre_bits, strict=True)]
                down += pre_down.bits
            message = method.worker_rule(grad, state, worker_ctx)
            reply, up_bits = EXCHANGES[method.exchange](method.server_rule, message, ctx, self.comm)
            up = [a + b for a, b in zip(up, up_bits, strict=True)]
            down += reply.bits
            method.apply_rule(reply, ctx)
        self.last_wire = self.comm.wire - before
        return DistStepBits(up, down, wire=self.last_wire)

    def mean_loss(self, losses: torch.Tensor) -> float:
        """Mean train loss over all workers: the N ranks' losses gathered in rank order, then averaged
        (the same float ops as the simulated cluster's mean)."""
        return self.comm.all_gather(losses.reshape(-1)).reshape(-1).mean().item()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the replicated method state and this worker's own state."""
        return {
            "rank": self.rank,
            "workers": self.num_workers,
            "methods": {str(d): m.state_dict() for d, m in self.methods.items()},
            "worker_state": {str(d): s for d, s in self.worker_states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("rank"), state.get("workers")) != (self.rank, self.num_workers):
            raise ValueError(
                f"rank {self.rank} of {self.num_workers} got the checkpoint of rank {state.get('rank')} "
                f"of {state.get('workers')}; resume with the same number of ranks"
            )
        for dtype, method in self.methods.items():
            method.load_state_dict(state["methods"][str(dtype)])
            self.worker_states[dtype] = state["worker_state"][str(dtype)]


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = [
    "EXCHANGES",
    "CollectiveError",
    "DistStepBits",
    "TorchDistCluster",
    "gather_messages",
    "gathered_exchange",
    "init_process_group",
    "mean_exchange",
    "shard_bytes",
    "sharded_exchange",
]
