"""CIFAR-10 with a timm ViT: decoded once into a uint8 tensor cache, augmented as batch tensors.

Data: `task.data` is a folder of Parquet files in the schema of the hub's `uoft-cs/cifar10` (`img`,
`label`; the default `cifar10` resolves against `$DISTLION_DATA` or `../shared/data`), an ImageFolder
tree (`train/<class>/*.png`, `test/<class>/*.png`) or `hub:uoft-cs/cifar10` when online.

Recipe (the paper's references): random crop with padding 4, horizontal flip, per-channel
normalization, label smoothing; optionally timm's RandAugment/AutoAugment and Mixup/CutMix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from distlion.tasks.base import ClassificationTask, stratified_split
from distlion.tasks.data import load_images, seeded_host_rngs

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
HOW = "download the Parquet files of uoft-cs/cifar10 from https://huggingface.co/datasets/uoft-cs/cifar10"


class Cifar10Task(ClassificationTask):
    """CIFAR-10: 45,000 train / 5,000 validation / 10,000 test images of 32x32, top-1 accuracy.

    Validation is `val_size` images of the official training set, stratified by class and drawn with
    `split_seed`; test is the official test set. `subset` / `test_subset` keep the first n rows of the
    official train / test sets (tests use a few hundred), validation is then carved from the kept rows.
    `auto_augment` is a timm policy string ("rand-m9-n2-mstd0.5" or "original"), `mixup` / `cutmix`
    the Beta parameters of timm's Mixup (0 = off).
    """

    def __init__(
        self,
        model: Any,
        data: str = "cifar10",
        val_size: int = 5000,
        split_seed: int = 0,
        val_examples: int | None = None,
        subset: int | None = None,
        test_subset: int | None = None,
        crop_padding: int = 4,
        flip: bool = True,
        label_smoothing: float = 0.0,
        auto_augment: str | None = None,
        mixup: float = 0.0,
        cutmix: float = 0.0,
        eval_batch_size: int = 1000,
        image_size: int = 32,
        num_classes: int = 10,
    ):
        super().__init__(model, label_smoothing, val_examples)
        check_image_model(model, image_size, "model=vit_cifar_cpu or model=vit_cifar_paper")
        pool_x, pool_y = load_images(data, "train", subset, image_size, "CIFAR-10", HOW)
        self.split_seed = split_seed
        self.train_index, self.val_index = stratified_split(pool_y, val_size, split_seed)
        self.train_x, self.train_y = pool_x[self.train_index], pool_y[self.train_index]
        self.val_x, self.val_y = pool_x[self.val_index], pool_y[self.val_index]
        self.test_x, self.test_y = load_images(data, "test", test_subset, image_size, "CIFAR-10", HOW)
        self.crop_padding = crop_padding
        self.flip = flip
        self.auto_augment = auto_augment
        self.eval_batch_size = eval_batch_size
        self.mean = torch.tensor(CIFAR10_MEAN, device="cpu").view(1, 3, 1, 1)
        self.std = torch.tensor(CIFAR10_STD, device="cpu").view(1, 3, 1, 1)
        self.mixup = None
        if mixup > 0 or cutmix > 0:
            from timm.data import Mixup

            # Mixup smooths the mixed targets itself, so the loss must not smooth them again.
            self.mixup = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=label_smoothing,
                               num_classes=num_classes, mode="pair")

    def augment(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.auto_augment:
            images = auto_augment(images, self.auto_augment, CIFAR10_MEAN, generator)
        return random_crop_flip(images, self.crop_padding, self.flip, generator)

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() / 255.0 - self.mean) / self.std

    def train_batch(self, indices, generator):
        inputs, targets = super().train_batch(indices, generator)
        if self.mixup is None:
            return inputs, targets
        return mixup_pairs(self.mixup, inputs, targets, generator)

    def per_example_loss(self, model, inputs, targets):
        if targets.dtype.is_floating_point:  # Mixup's soft targets, already smoothed
            return F.cross_entropy(model(inputs), targets, reduction="none")
        return super().per_example_loss(model, inputs, targets)


def mixup_pairs(mixup: Any, inputs: torch.Tensor, targets: torch.Tensor, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """timm Mixup/CutMix of example 2j with example 2j+1 -> (mixed inputs, soft targets).

    timm mixes example k with example B-1-k; ordering the batch as (0, 2, 4, ..., 5, 3, 1) makes those
    pairs (2j, 2j+1). The runner asks for one worker's batch at a time, but should it pass several
    workers' rows at once (even per-worker batches), no example is still mixed across two shards.
    """
    b = len(targets)
    if b % 2:
        raise ValueError(f"Mixup needs an even batch; the step's batch has {b} examples")
    order = torch.cat([torch.arange(0, b, 2, device="cpu"), torch.arange(b - 1, 0, -2, device="cpu")])
    with seeded_host_rngs(generator):
        mixed, soft = mixup(inputs[order].clone(), targets[order])
    inverse = torch.argsort(order)
    return mixed[inverse], soft[inverse]


def check_image_model(model: Any, image_size: int, hint: str) -> None:
    """Fail before training, in one line, when the model config is sized for other images."""
    size = model.get("img_size") if hasattr(model, "get") else None
    if size is not None and (int(size) != image_size or int(model.get("in_chans", 3)) != 3):
        raise ValueError(f"the model takes {model.get('in_chans', 3)}x{size}x{size} inputs, the task "
                         f"3x{image_size}x{image_size}; pass {hint}")


def random_crop_flip(images: torch.Tensor, padding: int, flip: bool, generator: torch.Generator
                     ) -> torch.Tensor:
    """Random crop with zero padding and horizontal flip of a uint8 batch [B, C, H, W], per image."""
    b, c, h, w = images.shape
    if padding > 0:
        padded = F.pad(images, (padding,) * 4)
        dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator, device="cpu")
        dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator, device="cpu")
        rows = (dy[:, None] + torch.arange(h, device="cpu"))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device="cpu"))[:, None, None, :]
        batch = torch.arange(b, device="cpu")[:, None, None, None]
        channel = torch.arange(c, device="cpu")[None, :, None, None]
        images = padded[batch, channel, rows, cols]
    if flip:
        mirror = torch.rand(b, generator=generator, device="cpu") < 0.5
        images = torch.where(mirror[:, None, None, None], images.flip(-1), images)
    return images


def auto_augment(images: torch.Tensor, policy: str, mean: tuple[float, ...], generator: torch.Generator
                 ) -> torch.Tensor:
    """timm's RandAugment (`policy="rand-m9-n2-mstd0.5"`) or AutoAugment (`"original"`), per image."""
    from timm.data.auto_augment import auto_augment_transform, rand_augment_transform

    hparams = {"translate_const": int(images.shape[-1] * 0.45),
               "img_mean": tuple(round(255 * m) for m in mean)}
    make = rand_augment_transform if policy.startswith("rand") else auto_augment_transform
    transform = make(policy, hparams)
    out = torch.empty_like(images)
    with seeded_host_rngs(generator):
        for i, image in enumerate(images):
            pil = Image.fromarray(image.permute(1, 2, 0).numpy())
            out[i] = torch.from_numpy(np.asarray(transform(pil)).copy()).permute(2, 0, 1)
    return out
