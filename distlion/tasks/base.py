"""What a task is: a training set addressed by index, a model, a per-example loss and an evaluation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from torch import nn


class Task(ABC):
    """A data set + model + loss. The sampler shards examples by index, so a task only maps
    indices to a batch; `evaluate` runs on the held-out split."""

    #: The summary metric of the task, and whether higher is better.
    metric: str = "eval_accuracy"
    higher_is_better: bool = True

    def __init__(self, model: Any):
        self.model_cfg = model

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
    """Image classification held as tensors in memory: cross-entropy, top-1 accuracy."""

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
