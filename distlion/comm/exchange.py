"""Exchanges: how one step's uplink messages reach the server rule and its downlink every worker.

Each exchange takes this process's uplink message, the server rule, and the counted collectives
(`distlion.comm.collectives`), and returns the downlink every rank now holds and the uplink bits of
each worker. Which one a method may use is its `exchange` (`distlion.methods.base.Method`):

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
  in_backward  Nothing left to send: DDP's comm hook all-reduced the gradient during backward
             (`distlion.methods.ddp`); the uplink is what the hook sent, an all-reduce returns the same
             size to every rank. Only one worker per process can run it (no simulated cluster).

With `Collectives.local()` (a world of one) every exchange is the server rule on the one message.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from distlion.comm.collectives import Collectives
from distlion.comm.message import Message

# Shards start on whole 64-bit words: the bit-sliced vote then works on views, and every shard starts
# at an element index that is a multiple of 64, so the alternating tie pattern keeps its parity.
SHARD_ALIGN_BYTES = 8

ServerRule = Callable[[list[Message]], Message]
"""The server's rule for one step: the N uplink messages -> the downlink message."""


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


def sharded_exchange(server_rule: ServerRule, up: Message, comm: Collectives) -> tuple[Message, list[int]]:
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
    shard_down = server_rule([Message(_split_row(row, up.tensors, shard)) for row in received])
    if any(t.dtype != torch.uint8 or t.shape[-1] != shard for t in shard_down.tensors.values()):
        raise TypeError("a sharded server rule must return packed uint8 [..., shard] tensors")
    gathered = comm.all_gather(torch.cat([t.reshape(-1) for t in shard_down.tensors.values()]))
    return Message(_from_shards(gathered, shard_down.tensors, num_bytes)), [up.bits] * n


def mean_exchange(server_rule: ServerRule, up: Message, comm: Collectives) -> tuple[Message, list[int]]:
    """A server rule of the uplinks' mean: all-reduce (SUM) each tensor, divide by N, apply the rule
    to that one message. Equal to the rule on the N messages up to the order of the fp32 sums."""
    n = comm.world_size
    mean = Message({k: comm.all_reduce(t.clone()).div_(n) for k, t in up.tensors.items()})
    return server_rule([mean]), [up.bits] * n


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


def gathered_exchange(server_rule: ServerRule, up: Message, comm: Collectives) -> tuple[Message, list[int]]:
    """Any server rule: all-gather the N uplinks, every rank runs the rule on all of them."""
    messages = gather_messages(up, comm)
    return server_rule(messages), [m.bits for m in messages]


def in_backward_exchange(server_rule: ServerRule, up: Message, comm: Collectives) -> tuple[Message, list[int]]:
    """The exchange already ran in backward (a DDP comm hook): the rule on this rank's record of it."""
    return server_rule([up]), [up.bits] * comm.world_size


EXCHANGES = {"sharded": sharded_exchange, "mean": mean_exchange, "allgather": gathered_exchange,
             "in_backward": in_backward_exchange}


def exchange(how: str, server_rule: ServerRule, up: Message, comm: Collectives) -> tuple[Message, list[int]]:
    """Run `server_rule` over the ranks of `comm` by the exchange named `how`."""
    if how not in EXCHANGES:
        raise ValueError(f"exchange {how!r} is unknown; choose one of {sorted(EXCHANGES)}")
    if comm.world_size == 1:  # every exchange of one message is the rule on it, with nothing on the wire
        return server_rule([up]), [up.bits]
    return EXCHANGES[how](server_rule, up, comm)


class Exchanger(Protocol):
    """How the uplinks of one step meet the server rule: what the step loop
    (`distlion.methods.step.algorithm1_step`) needs of a backend.

    `num_workers` is N, `local_workers` the workers whose messages this process builds, in order.
    """

    num_workers: int
    local_workers: list[int]

    def exchange(self, how: str, server_rule: ServerRule, messages: list[Message]) -> tuple[Message, list[int]]:
        """The local workers' uplinks -> (the downlink every worker holds, the uplink bits of all N workers).
        `how` is the method's exchange ("sharded", "mean", "allgather")."""
        ...

    def agree(self, flags: list[bool]) -> list[bool]:
        """The local workers' flags -> every worker's flag, in worker order (the same on every rank)."""
        ...


class InProcessExchange:
    """All N workers in this process: the server rule runs on their N messages, whatever `how` says."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.local_workers = list(range(num_workers))

    def exchange(self, how: str, server_rule: ServerRule, messages: list[Message]) -> tuple[Message, list[int]]:
        if how == "in_backward":
            raise ValueError("this method exchanges inside backward through DDP (one process per worker); run it "
                             "with cluster=torchdist under torchrun")
        return server_rule(messages), [m.bits for m in messages]

    def agree(self, flags: list[bool]) -> list[bool]:
        return list(flags)


class CollectiveExchange:
    """One worker per process (its rank in `comm`): the server rule distributed by the exchange `how`."""

    def __init__(self, comm: Collectives):
        self.comm = comm
        self.num_workers = comm.world_size
        self.local_workers = [comm.rank]

    def exchange(self, how: str, server_rule: ServerRule, messages: list[Message]) -> tuple[Message, list[int]]:
        (message,) = messages
        return exchange(how, server_rule, message, self.comm)

    def agree(self, flags: list[bool]) -> list[bool]:
        (flag,) = flags
        flags = self.comm.all_gather(torch.tensor([flag], dtype=torch.uint8, device=self.comm.device))
        return [bool(f) for f in flags.view(-1).tolist()]
