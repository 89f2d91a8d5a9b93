"""The one place every collective goes through: torch.distributed calls that count their bytes.

Each call adds the bytes this rank sends to and receives from its peers to `Collectives.wire`,
counted from the tensors at the call under the collective's cost (gloo and NCCL expose no byte
counters, so nothing is sniffed on the socket):

  all_to_all     sent: the input chunks addressed to the N-1 peers; received: the output chunks
                 from them (a rank's own chunk never crosses the wire)
  all_gather     sent: (N-1) x the input; received: the N-1 peers' inputs (any algorithm, ring
                 or direct, moves this much per rank)
  all_reduce     sent = received = 2 (N-1)/N x the tensor: the bandwidth-optimal ring
                 (reduce-scatter then all-gather); a model of the algorithm, not a measurement
  barrier        0

dtypes on gloo (CPU), probed on torch 2.14.1 with 4 ranks: uint8, int8, bool, int32, int64, float16,
bfloat16 and float32 work in all_to_all_single (even and uneven splits), all_gather_into_tensor (1-D
output of N x input only), all_gather, all_reduce (SUM, MAX) and broadcast, empty tensors included;
int16 is rejected by every collective ("Invalid scalar type"); uint8 SUM wraps around (4 x 200 -> 32),
so nothing here sums votes in a narrow type. NCCL has uint8 all-to-all and all-gather too (not run
here: no GPU).

Without an initialized process group (`Collectives.local()`), the world is this one process: every
call is the identity and counts 0 bytes, so single-process code takes the same path.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

# `all_gather_into_tensor` is deprecated in favour of `all_gather_single` from torch 2.14 on.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class WireBytes:
    """Bytes one rank sent to and received from its peers, and the collective calls it made."""

    sent: int = 0
    received: int = 0
    calls: int = 0

    @property
    def total(self) -> int:
        return self.sent + self.received

    def __add__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.sent + other.sent, self.received + other.received, self.calls + other.calls)

    def __sub__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.sent - other.sent, self.received - other.received, self.calls - other.calls)


class CollectiveError(RuntimeError):
    """A collective failed: a peer raised, died, or did not reach it within the group's timeout."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Collectives:
    """Counted collectives over one process group (the default group when `group` is None)."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: datetime.timedelta | None = None,
                 device: torch.device | str = "cpu"):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; Collectives.local() is one process")
        self.group = group
        self.device = torch.device(device)  # where this rank's collective tensors live (CUDA for NCCL)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout
        self.distributed = True
        self.wire = WireBytes()
        # Called when a collective fails: which peer stopped answering, in words ("" when it cannot tell).
        self.diagnose: Callable[[], str] = lambda: ""

    @classmethod
    def local(cls, device: torch.device | str = "cpu") -> Collectives:
        """A world of one process without torch.distributed."""
        comm = cls.__new__(cls)
        comm.group, comm.rank, comm.world_size, comm.timeout = None, 0, 1, None
        comm.device = torch.device(device)
        comm.distributed = False
        comm.wire = WireBytes()
        comm.diagnose = lambda: ""
        return comm

    def _call(self, name: str, sent: int, received: int, fn, *args, **kwargs) -> None:
        """Run one collective, count it, and turn a backend failure into one clear error."""
        if self.distributed:
            try:
                fn(*args, group=self.group, **kwargs)
            except RuntimeError as err:
                limit = f"{self.timeout.total_seconds():g} s" if self.timeout else "the group's timeout"
                first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                culprit = self.diagnose()  # e.g. "rank 1 stopped answering (...)"
                who = f"{culprit}, so it did not" if culprit else "a peer rank raised, died, or did not"
                raise CollectiveError(
                    f"rank {self.rank} of {self.world_size}: {name} failed: {who} reach it within {limit} "
                    f"(cluster.timeout_s): {first_line}"
                ) from err
        self.wire += WireBytes(sent, received, 1)

    def all_to_all(
        self,
        tensor: torch.Tensor,
        input_splits: list[int] | None = None,
        output_splits: list[int] | None = None,
    ) -> torch.Tensor:
        """1-D `tensor` in N chunks, chunk j to rank j; returns the N chunks received, in rank order.

        Equal chunks without splits; element counts per rank with them.
        """
        n, r = self.world_size, self.rank
        if input_splits is None:
            own_in = own_out = tensor.numel() // n
            out_numel = tensor.numel()
        else:
            own_in, own_out, out_numel = input_splits[r], output_splits[r], sum(output_splits)
        out = tensor.new_empty(out_numel)
        size = tensor.element_size()
        self._call(
            "all_to_all", (tensor.numel() - own_in) * size, (out_numel - own_out) * size,
            dist.all_to_all_single, out, tensor,
            output_split_sizes=output_splits, input_split_sizes=input_splits,
        )
        if not self.distributed:
            out.copy_(tensor)
        return out

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Collectives that are not the training's traffic (gathering the workers' replicas to evaluate their
        mean): they run, and `wire` stays as it was."""
        wire = self.wire
        try:
            yield
        finally:
            self.wire = wire

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all): [N, *tensor.shape], row j from rank j."""
        out = tensor.new_empty(self.world_size * tensor.numel())
        peers = (self.world_size - 1) * _nbytes(tensor)
        self._call("all_gather", peers, peers, _all_gather_single, out, tensor.contiguous().reshape(-1))
        if not self.distributed:
            out.copy_(tensor.reshape(-1))
        return out.view(self.world_size, *tensor.shape)

    def all_gather_uneven(self, tensor: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
        """Every rank's 1-D `tensor` when their sizes differ (`numels[j]` from rank j, known to all).

        An all-to-all with uneven splits: rank i sends its tensor to every peer and receives exactly
        theirs, with no padding to the largest (gloo's all-gather wants equal sizes).
        """
        n = self.world_size
        if tensor.numel() != numels[self.rank]:
            raise ValueError(f"rank {self.rank} holds {tensor.numel()} elements, not {numels[self.rank]}")
        out = self.all_to_all(tensor.repeat(n), input_splits=[tensor.numel()] * n, output_splits=numels)
        return list(out.split(numels))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place: the elementwise SUM or MAX over ranks (counted as the ring's 2 (N-1)/N x bytes)."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        n = self.world_size
        moved = 2 * (n - 1) * _nbytes(tensor) // n
        self._call(f"all_reduce({op})", moved, moved, dist.all_reduce, tensor, op=ops[op])
        return tensor

    def barrier(self) -> None:
        self._call("barrier", 0, 0, dist.barrier)
