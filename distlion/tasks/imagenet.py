"""ImageNet-style classification with timm ViTs (random init) and timm's train/eval transforms.

Data: `task.data` is an ImageFolder root with `train/<class>/*` and `val/<class>/*` (resolved against
`$DISTLION_DATA` when relative), or `hub:<id>` (e.g. `hub:ILSVRC/imagenet-1k`, columns `image` and
`label`) when online. Images are decoded per batch (ImageNet does not fit a decoded cache); the timm
transform of each image draws from RNGs seeded by the step's generator, so a batch is still a pure
function of (seed, step). Metrics: top-1 (`eval_accuracy`) and top-5 (`eval_top5`) accuracy.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from torch import nn

from distlion.tasks.base import Metric, Task
from distlion.tasks.cifar10 import check_image_model, mixup_pairs
from distlion.tasks.data import hub_id, is_hub_id, missing_data_error, resolve_path, seeded_host_rngs

HOW = "ImageNet-1k as an ImageFolder tree (train/<wnid>/*.JPEG, val/<wnid>/*.JPEG) from https://image-net.org"


class ImageNetTask(Task):
    """`num_classes` is read from the data and passed to the model; `eval_subset` evaluates on that many
    evenly spaced validation images (None = all)."""

    # Evaluated on `val_split`: ImageNet's test labels are not public, so this is validation accuracy.
    metrics = (
        Metric("eval_accuracy", "validation top-1 (%)", "validation", higher_is_better=True, scale=100.0, decimals=2),
        Metric("eval_top5", "validation top-5 (%)", "validation", higher_is_better=True, scale=100.0, decimals=2),
        Metric("eval_loss", "validation loss (nats)", "validation", higher_is_better=False),
    )

    def __init__(
        self,
        model: Any,
        data: str = "imagenet",
        image_size: int = 224,
        train_split: str = "train",
        val_split: str = "val",
        label_smoothing: float = 0.1,
        auto_augment: str | None = "rand-m9-mstd0.5-inc1",
        re_prob: float = 0.25,
        mixup: float = 0.8,
        cutmix: float = 1.0,
        eval_subset: int | None = None,
        eval_batch_size: int = 256,
        eval_workers: int = 0,
    ):
        super().__init__(model)
        check_image_model(model, image_size, "a model with img_size equal to task.image_size")
        from timm.data import create_transform

        self.label_smoothing = label_smoothing
        self.eval_batch_size = eval_batch_size
        self.eval_workers = eval_workers
        self.train_set, self.num_classes = _image_source(data, train_split)
        self.val_set, _ = _image_source(data, val_split)
        self.train_transform = create_transform(image_size, is_training=True, auto_augment=auto_augment,
                                                re_prob=re_prob, interpolation="bicubic")
        self.eval_transform = create_transform(image_size, is_training=False, interpolation="bicubic")
        if eval_subset is not None and eval_subset < len(self.val_set):
            step = len(self.val_set) / eval_subset
            self.eval_indices = [int(i * step) for i in range(eval_subset)]
        else:
            self.eval_indices = list(range(len(self.val_set)))
        self.mixup = None
        if mixup > 0 or cutmix > 0:
            from timm.data import Mixup

            self.mixup = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=label_smoothing,
                               num_classes=self.num_classes, mode="pair")

    @property
    def num_train(self) -> int:
        return len(self.train_set)

    def build_model(self) -> nn.Module:
        return hydra.utils.instantiate(self.model_cfg, num_classes=self.num_classes)

    def train_batch(self, indices, generator):
        images, labels = [], []
        with seeded_host_rngs(generator), _seeded_torch(generator):
            for i in indices.tolist():
                image, label = self.train_set[i]
                images.append(self.train_transform(image))
                labels.append(label)
        inputs, targets = torch.stack(images), torch.tensor(labels)
        if self.mixup is not None:
            return mixup_pairs(self.mixup, inputs, targets, generator)
        return inputs, targets

    def per_example_loss(self, model, inputs, targets):
        if targets.dtype.is_floating_point:  # Mixup's soft targets, already smoothed
            return F.cross_entropy(model(inputs), targets, reduction="none")
        return F.cross_entropy(model(inputs), targets, reduction="none", label_smoothing=self.label_smoothing)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        loader = torch.utils.data.DataLoader(
            torch.utils.data.Subset(_Transformed(self.val_set, self.eval_transform), self.eval_indices),
            batch_size=self.eval_batch_size, num_workers=self.eval_workers)
        loss_sum, top1, top5 = 0.0, 0, 0
        for x, y in loader:
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            best = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
            top1 += (best[:, 0] == y).sum().item()
            top5 += (best == y[:, None]).any(dim=-1).sum().item()
        model.train(was_training)
        n = len(self.eval_indices)
        return {"eval_loss": loss_sum / n, "eval_accuracy": top1 / n, "eval_top5": top5 / n}


class _Transformed(torch.utils.data.Dataset):
    def __init__(self, source, transform):
        self.source, self.transform = source, transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i):
        image, label = self.source[i]
        return self.transform(image), label


class _HubImages(torch.utils.data.Dataset):
    """A hub data set's rows as (RGB PIL image, label)."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i):
        row = self.ds[i]
        return row["image"].convert("RGB"), row["label"]


def _image_source(spec: str, split: str):
    """(data set of (PIL image, label), number of classes) for one split."""
    if is_hub_id(spec):
        import datasets

        ds = datasets.load_dataset(hub_id(spec), split=split)
        return _HubImages(ds), ds.features["label"].num_classes
    from torchvision.datasets import ImageFolder

    root = resolve_path(spec, "ImageNet", HOW) / split
    if not root.is_dir():
        raise missing_data_error(root, f"ImageNet ({split} split)", HOW)
    folder = ImageFolder(str(root))
    return folder, len(folder.classes)


@contextmanager
def _seeded_torch(generator: torch.Generator):
    """torchvision's random transforms draw from torch's global RNG: seed it from `generator` for a block."""
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
