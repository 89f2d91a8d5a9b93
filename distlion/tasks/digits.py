"""scikit-learn's 8x8 handwritten digits: real data that ships with an installed package.

1,797 images of 8x8 pixels (values 0..16), 10 classes; a stratified train/test split with a fixed
seed. Small enough for the embedded demo and the tests, real enough that accuracy means something.
"""

from __future__ import annotations

from typing import Any

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from distlion.tasks.base import ClassificationTask


class DigitsTask(ClassificationTask):
    def __init__(self, model: Any, test_fraction: float = 0.25, split_seed: int = 0, label_smoothing: float = 0.0):
        super().__init__(model, label_smoothing)
        images, labels = load_digits(return_X_y=True)
        x_train, x_test, y_train, y_test = train_test_split(
            images, labels, test_size=test_fraction, random_state=split_seed, stratify=labels
        )

        # Pixels 0..16 -> roughly zero-mean, unit-scale inputs of shape [1, 8, 8].
        def to_tensor(x):
            return (torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0 - 0.3) / 0.4

        self.train_x, self.test_x = to_tensor(x_train), to_tensor(x_test)
        self.train_y = torch.tensor(y_train, dtype=torch.long)
        self.test_y = torch.tensor(y_test, dtype=torch.long)
