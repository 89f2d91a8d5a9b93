"""What a task is: train / validation / test splits (training examples addressed by index), a model, a
per-example loss and an evaluation of either held-out split."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Metric:
    """One number a task's `evaluate()` returns, as tables and plots show it."""

    key: str
    """Key in `evaluate()`'s dict and in summary.json, e.g. "test_accuracy" or "val_loss"."""
    display: str
    """Column and axis title, naming the split and the unit, e.g. "test accuracy (%)"."""
    split: str
    """Where it is measured: "test" or "validation" (a reference may come from "train")."""
    higher_is_better: bool
    scale: float = 1.0
    """Display multiplier: 100 for a fraction shown in %."""
    decimals: int = 4
    """Decimals shown in tables."""
    reference: bool = False
    """A reference value (e.g. the unigram entropy), drawn as a line and written under the table, not a score."""
    reference_for: str | None = None
    """The key of the metric whose plots a reference is drawn on."""
    note: str = ""
    """Words written after a reference's value under the table: its unit and what it means."""

    def __post_init__(self) -> None:
        if self.split not in ("test", "validation", "train"):
            raise ValueError(f"metric {self.key!r}: split {self.split!r} is not test, validation or train")
        if self.reference != (self.reference_for is not None):
            raise ValueError(f"metric {self.key!r}: a reference names the metric it is drawn on, and only a reference")

    @property
    def quantity(self) -> str:
        """What is measured, whatever the split (see `quantity`)."""
        return quantity(self.key)


def quantity(key: str) -> str:
    """A metric key without its split: "accuracy" for "test_accuracy", "val_accuracy" and the older
    "eval_accuracy" (so a reference drawn on one is drawn on the others)."""
    for prefix in ("val_", "test_", "eval_"):
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    return key


#: The splits a task evaluates and the prefix of their metric keys: "val_accuracy", "test_loss".
SPLIT_PREFIXES = {"validation": "val_", "test": "test_"}


def split_metrics(measures: tuple[Metric, ...], splits: tuple[str, ...] = ("test", "validation")) -> tuple[Metric, ...]:
    """`Metric`s of each split from split-free templates: key "accuracy" -> "test_accuracy", display
    "{} accuracy (%)" -> "test accuracy (%)"; test first (the headline), then validation."""
    return tuple(dataclasses.replace(m, key=SPLIT_PREFIXES[split] + m.key, split=split, display=m.display.format(split))
                 for split in splits for m in measures)


def evenly_spaced(size: int, examples: int | None) -> torch.Tensor:
    """`examples` evenly spaced indices of range(size), all of them when None or larger."""
    if examples is None or examples >= size:
        return torch.arange(size, device="cpu")
    return (torch.arange(examples, device="cpu") * size) // examples


def stratified_split(labels: torch.Tensor | list[int], val_size: int, seed: int, what: str = "task.val_size"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, validation indices) of `labels`, both sorted: `val_size` examples drawn with `seed`,
    each class's count within one of its proportional share (scikit-learn's stratified shuffle split)."""
    from sklearn.model_selection import train_test_split

    n = len(labels)
    if not 0 < val_size < n:
        raise ValueError(f"{what}={val_size} must be between 0 and the {n} training examples it is carved from")
    train, val = train_test_split(torch.arange(n, device="cpu").numpy(), test_size=val_size, random_state=seed,
                                  stratify=torch.as_tensor(labels, device="cpu").numpy())
    return torch.from_numpy(train).sort().values, torch.from_numpy(val).sort().values


class Task(ABC):
    """A data set + model + loss, in three splits: train (the only one the sampler sees, by index),
    validation (everything that selects: evaluations during training, tuning, targets) and test (evaluated
    once at the end of a run, for the final tables)."""

    #: What `evaluate` returns, as the report shows it: the test split's headline metric first, then the
    #: other test and validation metrics (keys prefixed "test_" / "val_"), then reference values.
    metrics: tuple[Metric, ...] = ()
    #: The validation metric that tuning and targets read (a key of `metrics`, split "validation").
    objective: str = ""
    #: The metrics summaries declared before the validation split existed ("eval_*" keys, no "metrics"
    #: in summary.json): how the report reads those old runs.
    legacy_metrics: tuple[Metric, ...] = ()
    #: Validation examples per evaluation during training (None = all); the final evaluation uses all.
    val_examples: int | None = None

    def __init__(self, model: Any):
        if not self.metrics:
            raise TypeError(f"{type(self).__name__} declares no metrics")
        objective = next((m for m in self.metrics if m.key == self.objective), None)
        if objective is None or objective.split != "validation":
            raise TypeError(f"{type(self).__name__}.objective={self.objective!r} is not one of its validation metrics")
        self.model_cfg = model

    @property
    def metric(self) -> str:
        """Key of the headline metric (test split)."""
        return self.metrics[0].key

    @property
    @abstractmethod
    def num_train(self) -> int:
        """Number of training examples the sampler shards across workers."""

    @property
    @abstractmethod
    def splits(self) -> dict[str, Any]:
        """The split as summary.json records it: {"train": n, "validation": n, "test": n} plus what fixes it
        (the seed, the unit counted, ...)."""

    def build_model(self) -> nn.Module:
        return hydra.utils.instantiate(self.model_cfg)

    @abstractmethod
    def train_batch(self, indices: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for the given training indices; augmentation draws from `generator`."""

    @abstractmethod
    def per_example_loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of each example, shape [B]; a worker's loss is the mean over its examples."""

    @abstractmethod
    def measure(self, model: nn.Module, split: str, indices: torch.Tensor) -> dict[str, float]:
        """Unprefixed metrics ({"loss": ..., "accuracy": ...}) of the model in eval mode, without gradients,
        on the examples `indices` of `split` ("validation" or "test")."""

    def references(self) -> dict[str, float]:
        """Reference values (unprefixed keys, e.g. the unigram entropy of the train split) every evaluation reports."""
        return {}

    def evaluate(self, model: nn.Module, split: str, examples: int | None = None) -> dict[str, float]:
        """Metrics of `split` ("validation" or "test") with keys prefixed by it ("val_loss", "test_accuracy"),
        on `examples` evenly spaced examples of it (None = all), plus the reference values."""
        if split not in SPLIT_PREFIXES:
            raise ValueError(f"split {split!r} is not one of {sorted(SPLIT_PREFIXES)}")
        indices = evenly_spaced(self.splits[split], examples)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                values = self.measure(model, split, indices)
        finally:
            model.train(was_training)
        return {SPLIT_PREFIXES[split] + k: v for k, v in values.items()} | self.references()


def model_device(model: nn.Module) -> torch.device:
    """Where the model computes: evaluation batches, held on the CPU, go there."""
    return next(model.parameters()).device


CLASSIFICATION_MEASURES = (
    Metric("accuracy", "{} accuracy (%)", "test", higher_is_better=True, scale=100.0, decimals=2),
    Metric("loss", "{} loss (nats)", "test", higher_is_better=False),
)


class ClassificationTask(Task):
    """Image classification held as tensors in memory: cross-entropy and top-1 accuracy. Subclasses fill the
    train / val / test tensors (`train_x`, `train_y`, `val_x`, ...), `split_seed`, and `train_index` /
    `val_index`: where the train and validation examples sit in the training data they were carved from."""

    metrics = split_metrics(CLASSIFICATION_MEASURES)
    objective = "val_accuracy"
    legacy_metrics = (
        Metric("eval_accuracy", "test accuracy (%)", "test", higher_is_better=True, scale=100.0, decimals=2),
        Metric("eval_loss", "test loss (nats)", "test", higher_is_better=False),
    )
    eval_batch_size = 1024

    def __init__(self, model: Any, label_smoothing: float = 0.0, val_examples: int | None = None):
        super().__init__(model)
        self.label_smoothing = label_smoothing
        self.val_examples = val_examples
        self.split_seed: int
        self.train_index: torch.Tensor
        self.val_index: torch.Tensor
        self.train_x: torch.Tensor
        self.train_y: torch.Tensor
        self.val_x: torch.Tensor
        self.val_y: torch.Tensor
        self.test_x: torch.Tensor
        self.test_y: torch.Tensor

    @property
    def num_train(self) -> int:
        return len(self.train_y)

    def train_labels(self) -> torch.Tensor:
        """The training examples' labels (what cluster.shards=dirichlet splits by)."""
        return self.train_y

    @property
    def splits(self) -> dict[str, Any]:
        return {"train": len(self.train_y), "validation": len(self.val_y), "test": len(self.test_y),
                "unit": "images", "seed": self.split_seed, "stratified": True}

    def split_tensors(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, labels) of the "validation" or "test" split: the one place evaluation reads them."""
        return (self.val_x, self.val_y) if split == "validation" else (self.test_x, self.test_y)

    def augment(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Training-time augmentation of a batch; none by default."""
        return images

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        """Stored images -> model input (e.g. uint8 -> normalized float)."""
        return images

    def train_batch(self, indices, generator):
        images = self.augment(self.train_x[indices], generator)
        return self.prepare(images), self.train_y[indices]

    def per_example_loss(self, model, inputs, targets):
        return F.cross_entropy(model(inputs), targets, reduction="none", label_smoothing=self.label_smoothing)

    def measure(self, model: nn.Module, split: str, indices: torch.Tensor) -> dict[str, float]:
        images, labels = self.split_tensors(split)
        loss_sum, correct = 0.0, 0
        device = model_device(model)
        for batch in indices.split(self.eval_batch_size):
            logits = model(self.prepare(images[batch]).to(device))
            y = labels[batch].to(device)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(-1) == y).sum().item()
        return {"loss": loss_sum / len(indices), "accuracy": correct / len(indices)}
