"""Disjoint per-worker shards of the training set, reshuffled every epoch from a seed.

The batch of step t is a pure function of (seed, t), so a resumed run draws exactly the batches an
uninterrupted run would have, and two cluster backends given the same seed see the same data.
"""

from __future__ import annotations

import torch

from distlion.seeding import derive_seed


class ShardedSampler:
    """Worker i owns shard i (a fixed random subset); each step it takes `per_worker_batch` of them."""

    def __init__(self, num_examples: int, num_workers: int, per_worker_batch: int, seed: int):
        shard_size = num_examples // num_workers
        if per_worker_batch > shard_size:
            raise ValueError(
                f"cluster.per_worker_batch={per_worker_batch} is larger than a worker's shard of {shard_size} "
                f"examples ({num_examples} training examples / {num_workers} workers); lower "
                "cluster.per_worker_batch or cluster.workers"
            )
        self.num_workers = num_workers
        self.per_worker_batch = per_worker_batch
        self.seed = seed
        perm = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed))
        self.shards = perm[: shard_size * num_workers].view(num_workers, shard_size)
        self.steps_per_epoch = shard_size // per_worker_batch
        self._epoch = -1
        self._order: torch.Tensor | None = None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            orders = []
            for worker in range(self.num_workers):
                g = torch.Generator().manual_seed(derive_seed(self.seed, epoch, worker))
                orders.append(self.shards[worker][torch.randperm(self.shards.shape[1], generator=g)])
            self._order, self._epoch = torch.stack(orders), epoch
        return self._order

    def indices(self, step: int) -> torch.Tensor:
        """Example indices of step `step`, shape [workers, per_worker_batch]."""
        epoch, position = divmod(step, self.steps_per_epoch)
        start = position * self.per_worker_batch
        return self._epoch_order(epoch)[:, start : start + self.per_worker_batch]

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch
