"""Disjoint per-worker shards of the training set, reshuffled every epoch from a seed.

The batch of step t is a pure function of (seed, t), so a resumed run draws exactly the batches an
uninterrupted run would have, and two cluster backends given the same seed see the same data.

Shards are IID (`cluster.shards=iid`: equal random subsets) or not: `dirichlet` gives each class's
examples to the workers in proportions drawn from Dirichlet(alpha) (label skew, the federated benchmarks'
split; small alpha: each worker sees few classes), `by_source` gives each worker whole documents of a
text (document d to worker d mod N). Non-IID shards differ in size: each worker walks its own shard,
reshuffled whenever it is through, and an epoch is the mean shard over the per-worker batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from distlion.seeding import derive_seed

SHARDINGS = ("iid", "dirichlet", "by_source")


class ShardedSampler:
    """Worker i owns shard i (a fixed random subset, or the given `shards`); each step it takes `per_worker_batch`
    of them."""

    def __init__(self, num_examples: int, num_workers: int, per_worker_batch: int, seed: int,
                 shards: list[torch.Tensor] | None = None):
        self.num_workers = num_workers
        self.per_worker_batch = per_worker_batch
        self.seed = seed
        self.record: dict[str, Any] = {}  # what the run records of its shards (`shard_record`)
        if shards is not None:
            self._init_given(shards)
            return
        shard_size = num_examples // num_workers
        if per_worker_batch > shard_size:
            raise ValueError(
                f"cluster.per_worker_batch={per_worker_batch} is larger than a worker's shard of {shard_size} "
                f"examples ({num_examples} training examples / {num_workers} workers); lower "
                "cluster.per_worker_batch or cluster.workers"
            )
        perm = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed), device="cpu")
        self.shards = perm[: shard_size * num_workers].view(num_workers, shard_size)
        self.steps_per_epoch = shard_size // per_worker_batch
        self._epoch = -1
        self._order: torch.Tensor | None = None
        self.given: list[torch.Tensor] | None = None

    def _init_given(self, shards: list[torch.Tensor]) -> None:
        small = min(range(len(shards)), key=lambda w: len(shards[w]))
        if len(shards[small]) < self.per_worker_batch:
            raise ValueError(f"worker {small}'s shard has {len(shards[small])} examples < cluster.per_worker_batch="
                             f"{self.per_worker_batch}; lower the batch or the workers, or raise cluster.alpha")
        self.given = shards
        self.steps_per_epoch = sum(len(s) for s in shards) // len(shards) // self.per_worker_batch
        self._orders: dict[tuple[int, int], torch.Tensor] = {}

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            orders = []
            for worker in range(self.num_workers):
                g = torch.Generator().manual_seed(derive_seed(self.seed, epoch, worker))
                orders.append(self.shards[worker][torch.randperm(self.shards.shape[1], generator=g, device="cpu")])
            self._order, self._epoch = torch.stack(orders), epoch
        return self._order

    def _given_order(self, worker: int, epoch: int) -> torch.Tensor:
        """Worker `worker`'s own shard in the order of its `epoch`-th pass through it."""
        key = (worker, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * self.num_workers:
                self._orders.clear()
            shard = self.given[worker]
            g = torch.Generator().manual_seed(derive_seed(self.seed, epoch, worker))
            self._orders[key] = shard[torch.randperm(len(shard), generator=g, device="cpu")]
        return self._orders[key]

    def indices(self, step: int) -> torch.Tensor:
        """Example indices of step `step`, shape [workers, per_worker_batch]."""
        if self.given is not None:
            rows = []
            stream = torch.arange(step * self.per_worker_batch, (step + 1) * self.per_worker_batch, device="cpu")
            for worker, shard in enumerate(self.given):
                passes, place = stream // len(shard), stream % len(shard)  # a batch may straddle two passes
                rows.append(torch.cat([self._given_order(worker, int(e))[place[passes == e]] for e in passes.unique()]))
            return torch.stack(rows)
        epoch, position = divmod(step, self.steps_per_epoch)
        start = position * self.per_worker_batch
        return self._epoch_order(epoch)[:, start : start + self.per_worker_batch]

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch


def dirichlet_shards(labels: torch.Tensor, num_workers: int, alpha: float, seed: int,
                     min_size: int = 1, tries: int = 1000) -> list[torch.Tensor]:
    """Label-skewed shards (Hsu et al. 2019): each class's examples split over the workers in proportions drawn
    from Dirichlet(alpha, ..., alpha), redrawn until every shard holds `min_size` examples. Sorted indices."""
    if not alpha > 0:
        raise ValueError(f"cluster.alpha={alpha} must be > 0 (Dirichlet concentration; 0.1 is strong label skew)")
    rng = np.random.default_rng(derive_seed(seed, 0xD1A))
    labels = np.asarray(labels)
    classes = np.unique(labels)
    for _ in range(tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_workers)]
        for c in classes:
            members = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet([alpha] * num_workers))[:-1] * len(members)).astype(int)
            for worker, part in enumerate(np.split(members, cuts)):
                parts[worker].append(part)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in shards) >= min_size:
            return [torch.from_numpy(s).long() for s in shards]
    raise ValueError(f"Dirichlet(alpha={alpha}) left a worker fewer than {min_size} of {len(labels)} examples in "
                     f"{tries} draws; raise cluster.alpha or lower cluster.workers / cluster.per_worker_batch")


def source_shards(sources: torch.Tensor, num_workers: int) -> list[torch.Tensor]:
    """Each worker its own documents: the examples of document d go to worker d mod N."""
    documents = int(sources.max()) + 1
    if documents < num_workers:
        raise ValueError(f"cluster.shards=by_source: {documents} documents for {num_workers} workers; every worker "
                         "needs one of its own (use more documents, fewer workers, or cluster.shards=iid)")
    return [torch.nonzero(sources % num_workers == w).squeeze(1) for w in range(num_workers)]


def build_shards(kind: str, task: Any, num_workers: int, seed: int, alpha: float,
                 per_worker_batch: int) -> list[torch.Tensor] | None:
    """The shards `cluster.shards` names for `task` (None for IID: the sampler draws them)."""
    if kind not in SHARDINGS:
        raise ValueError(f"cluster.shards={kind!r} is unknown; choose one of {SHARDINGS}")
    if kind == "iid":
        return None
    if kind == "dirichlet":
        labels = task.train_labels() if hasattr(task, "train_labels") else None
        if labels is None:
            raise ValueError(f"cluster.shards=dirichlet splits by label; task {type(task).__name__} has no labels "
                             "(for text: cluster.shards=by_source)")
        return dirichlet_shards(labels, num_workers, alpha, seed, min_size=per_worker_batch)
    sources = task.train_sources() if hasattr(task, "train_sources") else None
    if sources is None:
        raise ValueError(f"cluster.shards=by_source splits by document; task {type(task).__name__} has none "
                         "(for labels: cluster.shards=dirichlet)")
    return source_shards(sources, num_workers)


def shard_record(shards: list[torch.Tensor] | None, kind: str, alpha: float, labels: torch.Tensor | None,
                 num_examples: int, num_workers: int) -> dict[str, Any]:
    """What summary.json and shards.json record: the kind, alpha, each shard's size and label histogram."""
    if shards is None:
        return {"kind": kind, "sizes": [num_examples // num_workers] * num_workers}
    record: dict[str, Any] = {"kind": kind, "sizes": [len(s) for s in shards]}
    if kind == "dirichlet":
        record["alpha"] = alpha
    if labels is not None:
        classes = int(labels.max()) + 1
        record["label_histograms"] = [torch.bincount(labels[s], minlength=classes).tolist() for s in shards]
    return record
