"""scikit-learn's 8x8 handwritten digits: real data that ships with an installed package.

1,797 images of 8x8 pixels (values 0..16), 10 classes. A stratified test split (450 images) with a fixed
seed, then a stratified validation split carved from the remaining 1,347 (270 by default, leaving 1,077 to
train on). Small enough for the embedded demo and the tests, real enough that accuracy means something.
"""

from __future__ import annotations

from typing import Any

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from distlion.tasks.base import ClassificationTask, stratified_split


class DigitsTask(ClassificationTask):
    def __init__(self, model: Any, test_fraction: float = 0.25, val_size: int = 270, split_seed: int = 0,
                 label_smoothing: float = 0.0, val_examples: int | None = None):
        super().__init__(model, label_smoothing, val_examples)
        self.split_seed = split_seed
        images, labels = load_digits(return_X_y=True)
        x_train, x_test, y_train, y_test = train_test_split(
            images, labels, test_size=test_fraction, random_state=split_seed, stratify=labels
        )

        # Pixels 0..16 -> roughly zero-mean, unit-scale inputs of shape [1, 8, 8].
        def to_tensor(x):
            return (torch.tensor(x, dtype=torch.float32, device="cpu").view(-1, 1, 8, 8) / 16.0 - 0.3) / 0.4

        pool_x, pool_y = to_tensor(x_train), torch.tensor(y_train, dtype=torch.long, device="cpu")
        self.train_index, self.val_index = stratified_split(pool_y, val_size, split_seed)
        self.train_x, self.train_y = pool_x[self.train_index], pool_y[self.train_index]
        self.val_x, self.val_y = pool_x[self.val_index], pool_y[self.val_index]
        self.test_x, self.test_y = to_tensor(x_test), torch.tensor(y_test, dtype=torch.long, device="cpu")
