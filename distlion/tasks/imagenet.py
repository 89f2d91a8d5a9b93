"""ImageNet-style classification with timm ViTs (random init) and timm's train/eval transforms.

Data: `task.data` is an ImageFolder root with `train/<class>/*` and `val/<class>/*` (resolved against
`$DISTLION_DATA` when relative), or `hub:<id>` (e.g. `hub:ILSVRC/imagenet-1k`, columns `image` and
`label`) when online. Images are decoded per batch (ImageNet does not fit a decoded cache); the timm
transform of each image draws from RNGs seeded by the step's generator, so a batch is still a pure
function of (seed, step). Splits: validation is `val_size` images of the training split held out
(stratified by class, drawn with `split_seed`), test is the official validation set (ImageNet's test labels
are not public). Metrics: top-1 (`test_accuracy`, `val_accuracy`) and top-5 (`test_top5`, `val_top5`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from torch import nn

from distlion.tasks.base import Metric, Task, model_device, split_metrics, stratified_split
from distlion.tasks.cifar10 import check_image_model, mixup_pairs
from distlion.tasks.data import hub_id, is_hub_id, missing_data_error, resolve_path, seeded_host_rngs

HOW = "ImageNet-1k as an ImageFolder tree (train/<wnid>/*.JPEG, val/<wnid>/*.JPEG) from https://image-net.org"


class ImageNetTask(Task):
    """`num_classes` is read from the data and passed to the model; `val_examples` evaluates on that many
    evenly spaced validation images during training (None = all)."""

    metrics = split_metrics((
        Metric("accuracy", "{} top-1 (%)", "test", higher_is_better=True, scale=100.0, decimals=2),
        Metric("top5", "{} top-5 (%)", "test", higher_is_better=True, scale=100.0, decimals=2),
        Metric("loss", "{} loss (nats)", "test", higher_is_better=False),
    ))
    objective = "val_accuracy"
    # Before the held-out slice of train existed, the official val set was evaluated as "validation".
    legacy_metrics = (
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
        test_split: str = "val",
        val_size: int = 10000,
        split_seed: int = 0,
        val_examples: int | None = None,
        label_smoothing: float = 0.1,
        auto_augment: str | None = "rand-m9-mstd0.5-inc1",
        re_prob: float = 0.25,
        mixup: float = 0.8,
        cutmix: float = 1.0,
        eval_batch_size: int = 256,
        eval_workers: int = 0,
    ):
        super().__init__(model)
        check_image_model(model, image_size, "a model with img_size equal to task.image_size")
        from timm.data import create_transform

        self.label_smoothing = label_smoothing
        self.eval_batch_size = eval_batch_size
        self.eval_workers = eval_workers
        self.val_examples = val_examples
        self.split_seed = split_seed
        pool, self.num_classes, labels = _image_source(data, train_split)
        self.train_index, self.val_index = stratified_split(labels, val_size, split_seed)
        self.train_set = torch.utils.data.Subset(pool, self.train_index.tolist())
        self._train_labels = torch.as_tensor(labels, device="cpu")[self.train_index]
        self.val_set = torch.utils.data.Subset(pool, self.val_index.tolist())
        self.test_set, _, _ = _image_source(data, test_split)
        self.train_transform = create_transform(image_size, is_training=True, auto_augment=auto_augment,
                                                re_prob=re_prob, interpolation="bicubic")
        self.eval_transform = create_transform(image_size, is_training=False, interpolation="bicubic")
        self.mixup = None
        if mixup > 0 or cutmix > 0:
            from timm.data import Mixup

            self.mixup = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=label_smoothing,
                               num_classes=self.num_classes, mode="pair")

    @property
    def num_train(self) -> int:
        return len(self.train_set)

    def train_labels(self) -> torch.Tensor:
        """The training images' labels (what cluster.shards=dirichlet splits by)."""
        return self._train_labels

    @property
    def splits(self) -> dict[str, Any]:
        return {"train": len(self.train_set), "validation": len(self.val_set), "test": len(self.test_set),
                "unit": "images", "seed": self.split_seed, "stratified": True}

    def split_source(self, split: str) -> torch.utils.data.Dataset:
        """The (PIL image, label) data set of "validation" or "test": the one place evaluation reads them."""
        return self.val_set if split == "validation" else self.test_set

    def build_model(self) -> nn.Module:
        return hydra.utils.instantiate(self.model_cfg, num_classes=self.num_classes)

    def train_batch(self, indices, generator):
        images, labels = [], []
        with seeded_host_rngs(generator), _seeded_torch(generator):
            for i in indices.tolist():
                image, label = self.train_set[i]
                images.append(self.train_transform(image))
                labels.append(label)
        inputs, targets = torch.stack(images), torch.tensor(labels, device="cpu")
        if self.mixup is not None:
            return mixup_pairs(self.mixup, inputs, targets, generator)
        return inputs, targets

    def per_example_loss(self, model, inputs, targets):
        if targets.dtype.is_floating_point:  # Mixup's soft targets, already smoothed
            return F.cross_entropy(model(inputs), targets, reduction="none")
        return F.cross_entropy(model(inputs), targets, reduction="none", label_smoothing=self.label_smoothing)

    def measure(self, model: nn.Module, split: str, indices: torch.Tensor) -> dict[str, float]:
        loader = torch.utils.data.DataLoader(
            torch.utils.data.Subset(_Transformed(self.split_source(split), self.eval_transform), indices.tolist()),
            batch_size=self.eval_batch_size, num_workers=self.eval_workers)
        loss_sum, top1, top5, device = 0.0, 0, 0, model_device(model)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            best = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
            top1 += (best[:, 0] == y).sum().item()
            top5 += (best == y[:, None]).any(dim=-1).sum().item()
        n = len(indices)
        return {"loss": loss_sum / n, "accuracy": top1 / n, "top5": top5 / n}


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
    """(data set of (PIL image, label), number of classes, labels) for one split."""
    if is_hub_id(spec):
        import datasets

        ds = datasets.load_dataset(hub_id(spec), split=split)
        return _HubImages(ds), ds.features["label"].num_classes, ds["label"]
    from torchvision.datasets import ImageFolder

    root = resolve_path(spec, "ImageNet", HOW) / split
    if not root.is_dir():
        raise missing_data_error(root, f"ImageNet ({split} split)", HOW)
    folder = ImageFolder(str(root))
    return folder, len(folder.classes), folder.targets


@contextmanager
def _seeded_torch(generator: torch.Generator):
    """torchvision's random transforms draw from torch's global RNG: seed it from `generator` for a block."""
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device="cpu"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
