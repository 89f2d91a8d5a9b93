"""What a task is: a training set addressed by index, a model, a per-example loss and an evaluation."""

from __future__ import annotations

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
    """Key in `evaluate()`'s dict and in summary.json, e.g. "eval_accuracy"."""
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


class Task(ABC):
    """A data set + model + loss. The sampler shards examples by index, so a task only maps
    indices to a batch; `evaluate` runs on the held-out split."""

    #: What `evaluate` returns, as the report shows it; the first entry is the headline metric.
    metrics: tuple[Metric, ...] = ()

    def __init__(self, model: Any):
        if not self.metrics:
            raise TypeError(f"{type(self).__name__} declares no metrics")
        self.model_cfg = model

    @property
    def metric(self) -> str:
        """Key of the headline metric."""
        return self.metrics[0].key

    @property
    @abstractmethod
    def num_train(self) -> int:
        """Number of training examples the sampler shards across workers."""

    def build_model(self) -> nn.Module:
        return hydra.utils.instantiate(self.model_cfg)

    @abstractmethod
    def train_batch(self, indices: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for the given training indices; augmentation draws from `generator`."""

    @abstractmethod
    def per_example_loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of each example, shape [B]; a worker's loss is the mean over its examples."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Metrics on the held-out split, e.g. {"eval_loss": ..., "eval_accuracy": ...}."""


class ClassificationTask(Task):
    """Image classification held as tensors in memory: cross-entropy, top-1 accuracy on the test split."""

    metrics = (
        Metric("eval_accuracy", "test accuracy (%)", "test", higher_is_better=True, scale=100.0, decimals=2),
        Metric("eval_loss", "test loss (nats)", "test", higher_is_better=False),
    )
    eval_batch_size = 1024

    def __init__(self, model: Any, label_smoothing: float = 0.0):
        super().__init__(model)
        self.label_smoothing = label_smoothing
        self.train_x: torch.Tensor
        self.train_y: torch.Tensor
        self.test_x: torch.Tensor
        self.test_y: torch.Tensor

    @property
    def num_train(self) -> int:
        return len(self.train_y)

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

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        loss_sum, correct = 0.0, 0
        for start in range(0, len(self.test_y), self.eval_batch_size):
            x = self.prepare(self.test_x[start : start + self.eval_batch_size])
            y = self.test_y[start : start + self.eval_batch_size]
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(-1) == y).sum().item()
        model.train(was_training)
        n = len(self.test_y)
        return {"eval_loss": loss_sum / n, "eval_accuracy": correct / n}
