"""What the sparse baselines (GradDrop, DGC) share: an exact top-k and the sparse exchange.

Both send the kept entries of a worker's accumulated gradient as (fp32 value, int32 index) pairs;
the server sums them and every worker applies the mean with a library optimizer.
"""

from __future__ import annotations

import math

import torch

from distlion.comm.message import Message
from distlion.flat import Segment
from distlion.methods.base import Method, StepContext
from distlion.methods.mean_gradient import MeanGradientMethod


def num_kept(numel: int, keep: float) -> int:
    """k = ceil(keep * numel), at least 1; the epsilon stops 0.01 * 100 = 1.0000000000000009 giving 2."""
    return max(1, math.ceil(numel * keep - 1e-9))


def exact_topk(importance: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of `importance` (>= 0), without the zeros (they carry nothing).

    A full top-k of a large tensor is slow on CPU, so candidates are first cut at a threshold that
    about 2k entries pass (the matching rank in an evenly strided sample); the top-k of the
    candidates is the exact top-k whenever at least k pass, else the full top-k is taken.
    """
    n = importance.numel()
    if k >= n:
        return importance.nonzero().squeeze(1)
    stride = max(1, n // max(1000, math.ceil(20 * n / k)))
    if stride > 1:
        sample = importance[::stride]
        rank = min(sample.numel(), math.ceil(2 * k * sample.numel() / n))
        candidates = (importance >= sample.topk(rank).values[-1]).nonzero().squeeze(1)
        if candidates.numel() >= k:
            idx = candidates[importance[candidates].topk(k, sorted=False).indices]
            return idx[importance[idx] > 0]
    idx = importance.topk(k, sorted=False).indices
    return idx[importance[idx] > 0]


class SparseMeanMethod(MeanGradientMethod):
    """Sparse values + indices up, the server's mean down, a library optimizer to apply it.

    Uplink per worker: `values` fp32 and `indices` int32 (global positions in the flat buffer) of the
    sent entries, 64 bits each, plus `dense` fp32 for the segments the method never sparsifies (DGC's
    biases and norms; empty for GradDrop), 32 bits each.
    Server: Delta = (1/N) sum_i sparse_i. The downlink is whichever of two encodings is smaller:
      sparse: the union U of the workers' indices, values fp32 + indices int32, plus the dense
              segments fp32: 64 |U| + 32 n_dense bits; chosen when 2 |U| < n_sparse;
      dense:  `mean_grad`, the whole mean fp32: 32 n bits (also on a tie).
    """

    exchange = "allgather"  # every rank gathers the sparse uplinks and runs the server rule itself

    def sparsifies(self, segment: Segment) -> bool:
        """Whether a segment's entries are sent sparse (else dense fp32)."""
        return True

    def bind(self, params: torch.Tensor, num_workers: int, layout=None) -> Method:
        super().bind(params, num_workers, layout)
        if params.numel() >= 2**31:
            raise ValueError(f"a flat buffer of {params.numel()} elements does not fit int32 indices")
        self.sparse_segments = [s for s in self.layout if self.sparsifies(s)]
        dense = [
            torch.arange(s.offset, s.stop, device=params.device)
            for s in self.layout
            if not self.sparsifies(s)
        ]
        self.dense_index = (
            torch.cat(dense) if dense else torch.zeros(0, dtype=torch.int64, device=params.device)
        )
        return self

    def uplink(self, indices: torch.Tensor, source: torch.Tensor, dense_source: torch.Tensor) -> Message:
        """The message of `source[indices]` sparse and the dense segments of `dense_source`."""
        return Message(
            {
                "values": source[indices].to(torch.float32),
                "indices": indices.to(torch.int32),
                "dense": dense_source[self.dense_index].to(torch.float32),
            }
        )

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        numel = self.params.numel()
        total = torch.zeros(numel, dtype=torch.float32, device=self.params.device)
        sent = torch.zeros(numel, dtype=torch.bool, device=self.params.device)
        for m in messages:
            idx = m["indices"].long()
            total.index_add_(0, idx, m["values"])
            sent[idx] = True
            total.index_add_(0, self.dense_index, m["dense"])
        total /= len(messages)
        union = sent.nonzero().squeeze(1)
        if 2 * union.numel() < numel - self.dense_index.numel():
            return Message(
                {"values": total[union], "indices": union.to(torch.int32), "dense": total[self.dense_index]}
            )
        return Message({"mean_grad": total})

    def decode(self, down: Message, ctx: StepContext) -> torch.Tensor:
        """The downlink as the dense mean update, fp32 [n]."""
        if "mean_grad" in down.tensors:
            return down["mean_grad"]
        update = torch.zeros(self.params.numel(), dtype=torch.float32, device=self.params.device)
        update[down["indices"].long()] = down["values"]
        update[self.dense_index] = down["dense"]
        return update
