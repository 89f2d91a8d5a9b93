"""Where a task's data comes from, and where decoded data is cached. Never a surprise download.

A task config names its data set as `data: <path or hub id>`:

- a local path: Parquet files (`<split>-*.parquet`, the Hugging Face hub layout), an ImageFolder tree
  (`<split>/<class>/<image>`) or plain text files (`<split>.txt`). A relative path resolves against the
  **data root**: the environment variable `DISTLION_DATA` when set, otherwise `<repo>/../shared/data`
  when that folder exists (the offline copies this project's tests and CI use);
- `hub:<owner>/<name>` (e.g. `hub:uoft-cs/cifar10`): loaded with `datasets.load_dataset`, which may
  download. Only ever when the user writes `hub:`, so an offline machine never tries the network.

Decoded data (image tensors, tokenizers, token ids) is cached under `DISTLION_CACHE`, by default
`<repo>/.cache/distlion`, in files whose names hash the source files and the settings. Images are
decoded once into a uint8 [N, 3, H, W] tensor: decoding 60,000 PNGs costs tens of seconds on 2 cores,
loading the 150 MB decoded CIFAR-10 from the cache well under one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

DATA_ENV = "DISTLION_DATA"
CACHE_ENV = "DISTLION_CACHE"
HUB_PREFIX = "hub:"
REPO_ROOT = Path(__file__).resolve().parents[2]


def data_root() -> Path | None:
    """`$DISTLION_DATA`, else `<repo>/../shared/data` if it exists, else None."""
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV]).expanduser()
    default = REPO_ROOT.parent / "shared" / "data"
    return default if default.is_dir() else None


def cache_dir(kind: str) -> Path:
    """A cache folder for one kind of derived data (`images`, `tokenizers`, `tokens`), created on demand."""
    root = Path(os.environ.get(CACHE_ENV) or REPO_ROOT / ".cache" / "distlion").expanduser()
    path = root / kind
    path.mkdir(parents=True, exist_ok=True)
    return path


def is_hub_id(spec: str) -> bool:
    return str(spec).startswith(HUB_PREFIX)


def hub_id(spec: str) -> str:
    return str(spec)[len(HUB_PREFIX) :]


def missing_data_error(tried: Path | str, what: str, how: str) -> FileNotFoundError:
    """The one error for absent data: which path was tried and how to provide the data."""
    return FileNotFoundError(
        f"{what} not found at {tried}; set {DATA_ENV}=<folder> (now: {os.environ.get(DATA_ENV) or 'unset'}) "
        f"or task.data=<path>, or task.data=hub:<id> when online ({how})"
    )


def resolve_path(spec: str | os.PathLike, what: str, how: str) -> Path:
    """A local data path: absolute as given, relative against the data root; it must exist."""
    path = Path(spec).expanduser()
    if not path.is_absolute():
        root = data_root()
        path = (root if root is not None else Path(f"${DATA_ENV}")) / path
    if not path.exists():
        raise missing_data_error(path, what, how)
    return path


def split_files(root: Path, split: str, suffix: str) -> list[Path]:
    """Files of one split: `<split>-*.<suffix>` or `<split>.<suffix>` or `<split>/*.<suffix>`, sorted."""
    files = sorted(root.glob(f"{split}-*.{suffix}")) + sorted(root.glob(f"{split}.{suffix}"))
    if not files and (root / split).is_dir():
        files = sorted((root / split).glob(f"*.{suffix}"))
    return files


def fingerprint(files: Iterable[Path]) -> list[Any]:
    """Name, size and mtime of each file: changes when a file is replaced, cheap to compute."""
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def cache_key(*parts: Any) -> str:
    """A short stable hash of JSON-serializable parts (source fingerprints + settings)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save through a temporary file, so a killed process never leaves half a cache file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    """`Path.write_text` through a temporary file (processes that build the same cache file never see half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".JPEG")


def load_images(spec: str, split: str, limit: int | None, size: int, what: str, how: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images [N, 3, size, size], int64 labels [N]) of one split, the first `limit` rows.

    `spec` is a folder of Parquet files (columns `img`/`image` and `label`), an ImageFolder tree
    (`<split>/<class>/*.png`) or `hub:<id>`. Decoded once, then read from the cache.
    """
    if is_hub_id(spec):
        source: list = [spec]
    else:
        root = resolve_path(spec, what, how)
        files = split_files(root, split, "parquet")
        if not files and (root / split).is_dir():
            files = sorted(p for p in (root / split).rglob("*") if p.suffix in IMAGE_SUFFIXES)
        if not files:
            raise missing_data_error(root / f"{split}-*.parquet", f"{what} ({split} split)", how)
        source = fingerprint(files)
    path = cache_dir("images") / f"{split}-{cache_key(source, split, limit, size)}.pt"
    if path.exists():
        cached = torch.load(path, mmap=True)
        return cached["images"], cached["labels"]
    if is_hub_id(spec):
        images, labels = _decode_hub(hub_id(spec), split, limit, size)
    elif files[0].suffix == ".parquet":
        images, labels = _decode_parquet(files, limit, size)
    else:
        images, labels = _decode_image_folder(root / split, limit, size)
    atomic_save({"images": images, "labels": labels}, path)
    return images, labels


def _to_chw(image: Image.Image, size: int) -> np.ndarray:
    image = image.convert("RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.BICUBIC)
    return np.asarray(image).transpose(2, 0, 1)


def _stack(arrays: list[np.ndarray], labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(np.stack(arrays)), torch.tensor(labels, dtype=torch.long, device="cpu")


def _image_column(names: list[str]) -> str:
    for name in ("img", "image"):
        if name in names:
            return name
    raise ValueError(f"no image column among {names}; expected 'img' or 'image' (the HF hub schema)")


def _decode_parquet(files: list[Path], limit: int | None, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    import pyarrow.parquet as pq

    arrays, labels = [], []
    for f in files:
        table = pq.read_table(f)
        column = _image_column(table.column_names)
        rows = table.num_rows if limit is None else min(table.num_rows, limit - len(labels))
        table = table.slice(0, rows)
        for cell in table.column(column).to_pylist():
            arrays.append(_to_chw(Image.open(io.BytesIO(cell["bytes"])), size))
        labels.extend(table.column("label").to_pylist())
        if limit is not None and len(labels) >= limit:
            break
    return _stack(arrays, labels)


def _decode_image_folder(root: Path, limit: int | None, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's ImageFolder convention: classes are the sorted sub-folder names."""
    from torchvision.datasets import ImageFolder

    folder = ImageFolder(str(root))
    samples = folder.samples if limit is None else folder.samples[:limit]
    arrays = [_to_chw(Image.open(p), size) for p, _ in samples]
    return _stack(arrays, [label for _, label in samples])


def _decode_hub(name: str, split: str, limit: int | None, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    import datasets

    ds = datasets.load_dataset(name, split=split if limit is None else f"{split}[:{limit}]")
    column = _image_column(ds.column_names)
    arrays, labels = [], []
    for row in ds:
        arrays.append(_to_chw(row[column], size))
        labels.append(row["label"])
    return _stack(arrays, labels)


@contextmanager
def seeded_host_rngs(generator: torch.Generator) -> Iterator[None]:
    """Seed Python's and NumPy's global RNGs from `generator` for a block, then restore them.

    timm's RandAugment and Mixup draw from those global RNGs; seeding them from the step's generator
    keeps a batch a pure function of (seed, step), as the sampler promises.
    """
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device="cpu"))
    py_state, np_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
