"""Non-IID workers (`cluster.shards`): Dirichlet label skew and documents by source are disjoint, cover the data,
are fixed by the seed, and each worker walks its own shard; IID runs are the runs made before the setting."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import open_dict

from distlion.cluster.sampler import ShardedSampler, dirichlet_shards, source_shards
from distlion.runio import config_hash
from distlion.train import run

LABELS = torch.arange(10).repeat_interleave(60)  # 600 examples, 10 classes


def test_dirichlet_shards_are_disjoint_cover_the_data_and_follow_the_seed():
    shards = dirichlet_shards(LABELS, 8, alpha=0.1, seed=3, min_size=8)
    everything = torch.cat(shards)
    assert len(everything) == len(LABELS) and torch.equal(everything.sort().values, torch.arange(len(LABELS)))
    assert all(len(s) >= 8 for s in shards)
    again = dirichlet_shards(LABELS, 8, alpha=0.1, seed=3, min_size=8)
    assert all(torch.equal(a, b) for a, b in zip(shards, again, strict=True))
    other = dirichlet_shards(LABELS, 8, alpha=0.1, seed=4, min_size=8)
    assert any(not torch.equal(a, b) for a, b in zip(shards, other, strict=True))


def test_small_alpha_skews_the_labels_and_large_alpha_does_not():
    def classes_per_worker(alpha: float) -> float:
        shards = dirichlet_shards(LABELS, 8, alpha=alpha, seed=0)
        # classes holding at least 5% of a worker's shard (a uniform share is 10%)
        return sum(int((torch.bincount(LABELS[s], minlength=10) >= 0.05 * len(s)).sum()) for s in shards) / 8

    assert classes_per_worker(0.1) <= 3.5
    assert classes_per_worker(100.0) >= 9.5


def test_documents_by_source():
    sources = torch.tensor([0, 0, 1, 2, 2, 2, 3, 1, 4])
    shards = source_shards(sources, 2)
    assert [s.tolist() for s in shards] == [[0, 1, 3, 4, 5, 8], [2, 6, 7]]
    with pytest.raises(ValueError, match="5 documents for 8 workers"):
        source_shards(sources, 8)


def test_each_worker_walks_its_own_shard_once_per_pass():
    shards = [torch.arange(0, 10), torch.arange(10, 14), torch.arange(14, 30)]
    sampler = ShardedSampler(30, 3, per_worker_batch=2, seed=0, shards=shards)
    assert sampler.steps_per_epoch == 10 // 2  # the mean shard (10) over the batch
    drawn = torch.cat([sampler.indices(step) for step in range(10)], dim=1)  # 20 draws per worker
    for worker, shard in enumerate(shards):
        size = len(shard)
        for start in range(0, 20 - size + 1, size):  # every whole pass is a permutation of the shard
            assert sorted(drawn[worker, start:start + size].tolist()) == shard.tolist()
    fresh = ShardedSampler(30, 3, per_worker_batch=2, seed=0, shards=shards)
    assert torch.equal(fresh.indices(7), sampler.indices(7))  # a pure function of (seed, step): resumable
    with pytest.raises(ValueError, match=r"worker 1's shard has 4 examples < cluster.per_worker_batch=5"):
        ShardedSampler(30, 3, per_worker_batch=5, seed=0, shards=shards)


def test_a_dirichlet_run_records_its_shards_and_iid_keeps_the_old_hash(make_cfg, tmp_path):
    cfg = make_cfg("cluster.workers=4", "train.steps=10", "cluster.shards=dirichlet", "cluster.alpha=0.5")
    summary = run(cfg, tmp_path / "skewed")
    record = json.loads((tmp_path / "skewed" / "shards.json").read_text())
    assert summary["shards"] == "dirichlet" and summary["shard_alpha"] == 0.5
    assert sum(record["sizes"]) == summary["splits"]["train"] and len(record["label_histograms"]) == 4
    assert [sum(h) for h in record["label_histograms"]] == record["sizes"]
    iid = make_cfg("cluster.workers=4", "train.steps=10")
    without = iid.copy()
    with open_dict(without):
        del without.cluster["shards"], without.cluster["alpha"]
    assert config_hash(iid) == config_hash(without) != config_hash(cfg)
    with pytest.raises(ValueError, match="cluster.shards=by_source splits by document; task DigitsTask has none"):
        run(make_cfg("cluster.workers=4", "train.steps=10", "cluster.shards=by_source"), tmp_path / "bad")


def test_text_blocks_know_their_document(tmp_path):
    """Three books of 40, 24 and 64 training bytes (+ end-of-text each): 8-byte blocks by the book they start in."""
    from distlion.tasks.lm import LanguageModelTask

    for split, books in {"train": ["a" * 50, "b" * 30, "c" * 80], "validation": ["x" * 80, "y" * 80, "z" * 80]}.items():
        for i, text in enumerate(books):
            (tmp_path / f"{split}-{i}.txt").write_text(text)
    task = LanguageModelTask({"max_position_embeddings": 16}, data=str(tmp_path), block_size=8, tokenizer="bytes",
                             val_fraction=0.2, random_offset=False)
    assert task.train_ids.tolist() == [*b"a" * 40, 256, *b"b" * 24, 256, *b"c" * 64, 256]
    starts = (torch.arange(task.num_train) * 8).tolist()
    # a block starting on an end-of-text token belongs to the book that token closes (positions 40 and 65)
    assert task.train_sources().tolist() == [0 if s <= 40 else 1 if s <= 65 else 2 for s in starts]
