"""Every task's train / validation / test splits: disjoint, deterministic, of the configured sizes,
stratified for classification, recorded in summary.json; a run reads the test split once, at its end."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter

import pytest
import torch

import distlion.tasks.data as data_module
from distlion.tasks.base import ClassificationTask, evenly_spaced
from distlion.tasks.cifar10 import Cifar10Task
from distlion.tasks.data import DATA_ENV, data_root
from distlion.tasks.digits import DigitsTask
from distlion.tasks.lm import LanguageModelTask, carve_validation
from distlion.train import run

needs_data = pytest.mark.skipif(
    (data_root() is None or not (data_root() / "cifar10").is_dir()) and not os.environ.get("DISTLION_REQUIRE_DATA"),
    reason=f"the offline data sets are absent: set {DATA_ENV} to a copy of shared/data",
)


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(data_module.CACHE_ENV, str(tmp_path / "cache"))


def digests(rows: torch.Tensor) -> set[str]:
    """Content hashes of the rows (images or token blocks)."""
    return {hashlib.sha256(row.contiguous().numpy().tobytes()).hexdigest() for row in rows}


def check_classification_splits(task: ClassificationTask, again: ClassificationTask, sizes: dict[str, int]) -> None:
    assert {k: task.splits[k] for k in sizes} == sizes
    assert [len(task.train_x), len(task.val_x), len(task.test_x)] == list(sizes.values())
    # Disjoint: by position in the data they were carved from, and by content from each other and from test.
    train, val = set(task.train_index.tolist()), set(task.val_index.tolist())
    assert not train & val and train | val == set(range(sizes["train"] + sizes["validation"]))
    images = {split: digests(x) for split, x in (("train", task.train_x), ("val", task.val_x), ("test", task.test_x))}
    assert not images["train"] & images["val"] and not (images["train"] | images["val"]) & images["test"]
    # Deterministic: built twice, the same split.
    for name in ("train_x", "train_y", "val_x", "val_y", "test_x", "test_y"):
        assert torch.equal(getattr(task, name), getattr(again, name)), name
    # Stratified: each class's validation count within one of its share of the data the split was carved from.
    pool = Counter(task.train_y.tolist()) + Counter(task.val_y.tolist())
    val_counts = Counter(task.val_y.tolist())
    n_pool = sizes["train"] + sizes["validation"]
    for label, count in pool.items():
        assert abs(val_counts[label] - sizes["validation"] * count / n_pool) <= 1, label


def test_digits_splits():
    sizes = {"train": 1077, "validation": 270, "test": 450}
    check_classification_splits(DigitsTask({}), DigitsTask({}), sizes)
    assert not torch.equal(DigitsTask({}, split_seed=1).val_index, DigitsTask({}).val_index)  # the seed draws it
    assert DigitsTask({}, val_size=100).splits["validation"] == 100


@needs_data
def test_cifar10_splits():
    settings = {"subset": 1000, "val_size": 200, "test_subset": 100}
    task, again = Cifar10Task({"img_size": 32}, **settings), Cifar10Task({"img_size": 32}, **settings)
    check_classification_splits(task, again, {"train": 800, "validation": 200, "test": 100})


def test_a_validation_split_as_large_as_the_data_is_one_clear_error():
    with pytest.raises(ValueError, match="task.val_size=1347 must be between 0 and the 1347 training examples"):
        DigitsTask({}, val_size=1347)


@needs_data
def test_text_splits():
    settings = {"max_chars": 20000, "block_size": 64, "tokenizer": "bytes", "val_fraction": 0.1}
    task, again = LanguageModelTask({}, **settings), LanguageModelTask({}, **settings)
    # Validation is the end of the (kept) training text, test the data's own held-out file.
    assert len(task.train_ids) == 18000 + 1 and len(task.val_ids) == 2000 + 1 and len(task.test_ids) == 20000 + 1
    assert task.splits == {"train": 18000 // 64 - 1, "validation": 2000 // 64, "test": 20000 // 64,
                           "unit": "blocks of 64 tokens", "val_fraction": 0.1}
    for name in ("train_ids", "val_ids", "test_ids"):
        assert torch.equal(getattr(task, name), getattr(again, name)), name

    def blocks(ids: torch.Tensor) -> set[str]:
        return digests(ids[: (len(ids) - 1) // 64 * 64].view(-1, 64))

    train, val, test = blocks(task.train_ids), blocks(task.val_ids), blocks(task.test_ids)
    assert not train & val and not (train | val) & test


def test_validation_text_is_the_contiguous_end_of_each_document():
    books = ["a" * 90 + "b" * 10, "c" * 45 + "d" * 5]
    train, val = carve_validation(books, 0.1)
    assert train == ["a" * 90, "c" * 45] and val == ["b" * 10, "d" * 5]
    assert [t + v for t, v in zip(train, val, strict=True)] == books


def test_evaluations_during_training_may_use_evenly_spaced_examples():
    assert evenly_spaced(10, 4).tolist() == [0, 2, 5, 7]
    assert evenly_spaced(3, None).tolist() == evenly_spaced(3, 5).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="split 'train' is not one of"):
        DigitsTask({}).evaluate(torch.nn.Identity(), "train")


def test_a_run_reads_the_test_split_once_after_its_last_step(make_cfg, tmp_path, monkeypatch):
    events: list[tuple[str, ...]] = []
    evaluate, split_tensors, train_batch = DigitsTask.evaluate, DigitsTask.split_tensors, DigitsTask.train_batch

    def logged_evaluate(self, model, split, examples=None):
        events.append(("evaluate", split, examples))
        return evaluate(self, model, split, examples)

    def logged_split_tensors(self, split):  # the one place evaluation reads a held-out split's data
        events.append(("read", split))
        return split_tensors(self, split)

    def logged_train_batch(self, indices, generator):
        events.append(("train",))
        return train_batch(self, indices, generator)

    monkeypatch.setattr(DigitsTask, "evaluate", logged_evaluate)
    monkeypatch.setattr(DigitsTask, "split_tensors", logged_split_tensors)
    monkeypatch.setattr(DigitsTask, "train_batch", logged_train_batch)
    summary = run(make_cfg("train.steps=6", "train.eval_every=2", "cluster.workers=2", "cluster.per_worker_batch=8",
                           "task.val_examples=100"), tmp_path)

    last_train = max(i for i, e in enumerate(events) if e == ("train",))
    test_events = [i for i, e in enumerate(events) if e[0] != "train" and e[1] == "test"]
    assert len(test_events) == 2 and min(test_events) > last_train  # one evaluation, one read, after training
    # During training `val_examples` of validation; at the end all of it, then the test split.
    assert [e[1:] for e in events if e[0] == "evaluate"] == [("validation", 100), ("validation", 100),
                                                             ("validation", None), ("test", None)]

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "val_accuracy" in m] == [2, 4, 6]
    assert [m["step"] for m in lines if "test_accuracy" in m] == [6]
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["splits"] == {"train": 1077, "validation": 270, "test": 450, "unit": "images", "seed": 0,
                                 "stratified": True}
    assert written["metric"] == "test_accuracy" and written["objective"] == "val_accuracy"
    assert written["test_accuracy"] == lines[-1]["test_accuracy"] == summary["test_accuracy"]
    assert written["val_accuracy"] == lines[-1]["val_accuracy"]
