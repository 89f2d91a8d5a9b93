"""LLaMA-style causal language modelling on contiguous token blocks.

Model: `transformers.LlamaForCausalLM` (RMSNorm, RoPE, SwiGLU), random init, built by `build_llama`
with the tokenizer's vocabulary size; or a pretrained one (`model=llama_pretrained model.pretrained=<folder>`,
`load_llama`), whose own tokenizer then tokenizes the data: a finetune. `train.save_model=true` saves a run's
final model and tokenizer with `save_pretrained` into `<run dir>/model`, the folder the next run loads.

Data: `task.data` is a folder holding `<split>-*.parquet`
(a `text` column, one document per row) or `<split>.txt` for the splits `train` and `validation`
(Tiny Shakespeare and the Gutenberg books in `$DISTLION_DATA/text/`), a single .txt/.parquet file (its
last `test_fraction` is held out), or `hub:<id>` (e.g. `hub:Skylion007/openwebtext`) when online.

Splits: the data's held-out text (the `validation` files) is the test split. Validation is carved from the
training text: the last `val_fraction` of each training document, a contiguous slice before the text the
model trains on ends, so it never overlaps the test text. The tokenizer is trained on the train split only.

Documents are tokenized (see `distlion.tasks.tokenizer`), joined with an end-of-text token, and cut
into blocks of `block_size + 1` tokens: example i is block i (inputs = its first `block_size` tokens,
targets = the next-token shift), so the sampler's shard of indices is each worker's own stretch of text.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from torch import nn

from distlion.tasks.base import Metric, Task, model_device, split_metrics
from distlion.tasks.data import (
    atomic_save,
    cache_dir,
    hub_id,
    is_hub_id,
    missing_data_error,
    resolve_path,
    split_files,
)
from distlion.tasks.tokenizer import PretrainedTokenizer, build_tokenizer, text_digest

HOW = ("a folder with train/validation .txt or Parquet files with a `text` column, e.g. Tiny Shakespeare "
       "from https://github.com/karpathy/char-rnn (data/tinyshakespeare/input.txt)")


def build_llama(vocab_size: int, **config: Any) -> nn.Module:
    """A randomly initialised `LlamaForCausalLM` from `LlamaConfig(**config)`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **config))


def pretrained_source(spec: str) -> str:
    """What `from_pretrained` takes for `model.pretrained`: a local folder (it must hold config.json) or, for
    `hub:<id>`, the id (the Hugging Face cache, or the hub when online)."""
    if is_hub_id(spec):
        return hub_id(spec)
    path = Path(str(spec)).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.pretrained={spec}: no config.json in {path.resolve()}; point it at a folder written by "
            "save_pretrained (a run with train.save_model=true writes <run dir>/model), or hub:<id> when online")
    return str(path)


def pretrained_of(model_cfg: Any) -> str | None:
    """`model.pretrained` as `from_pretrained` takes it (`pretrained_source`), None for a fresh model: read before a
    task loads its data, so that a wrong folder is the first error."""
    pretrained = (model_cfg or {}).get("pretrained")
    return pretrained_source(pretrained) if pretrained else None


def save_pretrained(model: nn.Module, tokenizer: Any, path: Path) -> None:
    """The model and its tokenizer with `save_pretrained`: what `model.pretrained=<path>` loads."""
    if not hasattr(tokenizer, "to_hf"):
        raise ValueError(f"train.save_model needs a tokenizer transformers can load; task.tokenizer={tokenizer.kind} "
                         "has none: use task.tokenizer=bpe")
    model.save_pretrained(path)
    tokenizer.to_hf().save_pretrained(path)


def load_llama(pretrained: str, vocab_size: int | None = None) -> nn.Module:
    """A pretrained `LlamaForCausalLM` (see `pretrained_source`), in float32 (`train.dtype` casts it)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(pretrained_source(pretrained), dtype=torch.float32)
    if vocab_size is not None and model.config.vocab_size < vocab_size:
        raise ValueError(f"model.pretrained={pretrained} has {model.config.vocab_size} token embeddings, fewer than "
                         f"its tokenizer's {vocab_size} tokens")
    return model


class LanguageModelTask(Task):
    """Next-token prediction; metrics: loss (nats/token) and perplexity = exp(loss) of each held-out split.

    `unigram_entropy` (nats/token of the tokenizer's training data) is the loss of the best model that
    ignores context: the reference line a trained model must fall well below.
    """

    metrics = (
        *split_metrics((Metric("loss", "{} loss (nats/token)", "test", higher_is_better=False),
                        Metric("perplexity", "{} perplexity", "test", higher_is_better=False))),
        Metric("unigram_entropy", "unigram entropy of the tokenizer's training data", "train",
               higher_is_better=False, decimals=3, reference=True, reference_for="test_loss",
               note="nats/token (the loss of the best model that ignores context)"),
    )
    objective = "val_loss"
    legacy_metrics = (
        Metric("eval_loss", "validation loss (nats/token)", "validation", higher_is_better=False),
        Metric("eval_perplexity", "validation perplexity", "validation", higher_is_better=False),
        Metric("unigram_entropy", "unigram entropy of the tokenizer's training data", "train",
               higher_is_better=False, decimals=3, reference=True, reference_for="eval_loss",
               note="nats/token (the validation loss of the best model that ignores context)"),
    )

    def __init__(
        self,
        model: Any,
        data: str = "text/tinyshakespeare",
        block_size: int = 256,
        tokenizer: str = "bpe",
        vocab_size: int = 1024,
        max_chars: int | None = None,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        random_offset: bool = True,
        val_examples: int | None = 64,
        eval_batch_size: int = 16,
        exclude_documents: list[int] | None = None,
    ):
        super().__init__(model)
        self.block_size = block_size
        self.random_offset = random_offset
        self.eval_batch_size = eval_batch_size
        self.val_examples = val_examples
        self.val_fraction = val_fraction
        source = pretrained_of(model)
        train_texts, test_texts = load_texts(data, test_fraction)
        if exclude_documents:
            train_texts, test_texts = _exclude(train_texts, test_texts, list(exclude_documents))
        if max_chars is not None:
            train_texts, test_texts = _truncate(train_texts, max_chars), _truncate(test_texts, max_chars)
        train_texts, val_texts = carve_validation(train_texts, val_fraction)
        # A pretrained model keeps the tokenizer it was trained with; a fresh one gets its own, trained here.
        self.tokenizer = (PretrainedTokenizer(source) if source
                          else build_tokenizer(tokenizer, vocab_size, train_texts))
        self.train_ids = self._token_ids(train_texts)
        self.val_ids = self._token_ids(val_texts)
        self.test_ids = self._token_ids(test_texts)
        self.test_texts = test_texts  # the few-shot tasks' passages (distlion.tasks.fewshot)
        counts = torch.bincount(self.train_ids.long(), minlength=self.tokenizer.vocab_size).double()
        p = counts[counts > 0] / counts.sum()
        self.unigram_entropy = float(-(p * p.log()).sum())
        #: Tokens each example contributes (the runner's tokens/s = examples/s * this).
        self.tokens_per_example = block_size
        # A random start offset needs one block of slack at the end of the text.
        self._num_train = (len(self.train_ids) - 1) // block_size - int(random_offset)
        self._num_blocks = {split: (len(self.split_ids(split)) - 1) // block_size for split in ("validation", "test")}
        if self._num_train < 1 or min(self._num_blocks.values()) < 1:
            raise ValueError(f"the text is too short for task.block_size={block_size}: {len(self.train_ids)} train / "
                             f"{len(self.val_ids)} validation / {len(self.test_ids)} test tokens; "
                             "lower block_size or raise max_chars")

    @property
    def num_train(self) -> int:
        return self._num_train

    def train_sources(self) -> torch.Tensor:
        """The document each training block starts in (what cluster.shards=by_source splits by)."""
        document = torch.cumsum((self.train_ids == self.tokenizer.eot_id).long(), 0) - (
            self.train_ids == self.tokenizer.eot_id).long()  # an end-of-text token closes its own document
        return document[torch.arange(self._num_train, device="cpu") * self.block_size]

    @property
    def splits(self) -> dict[str, Any]:
        return {"train": self._num_train, **self._num_blocks, "unit": f"blocks of {self.block_size} tokens",
                "val_fraction": self.val_fraction}

    def split_ids(self, split: str) -> torch.Tensor:
        """Token ids of "validation" or "test": the one place evaluation reads them."""
        return self.val_ids if split == "validation" else self.test_ids

    def _token_ids(self, texts: list[str]) -> torch.Tensor:
        """Token ids of the documents joined by end-of-text, cached by tokenizer and text."""
        path = cache_dir("tokens") / f"{self.tokenizer.key}-{text_digest(texts)}.pt"
        if path.exists():
            return torch.load(path)
        ids = []
        for doc in self.tokenizer.encode(texts):
            ids.extend(doc)
            ids.append(self.tokenizer.eot_id)
        tensor = torch.tensor(ids, dtype=torch.int32, device="cpu")
        atomic_save(tensor, path)
        return tensor

    def build_model(self) -> nn.Module:
        if self.model_cfg.get("pretrained"):
            model = hydra.utils.instantiate(self.model_cfg, vocab_size=self.tokenizer.vocab_size)
            positions = model.config.max_position_embeddings
            if positions < self.block_size:
                raise ValueError(f"model.pretrained={self.model_cfg.pretrained} has {positions} positions < "
                                 f"task.block_size={self.block_size}; lower task.block_size")
            return model
        positions = self.model_cfg.get("max_position_embeddings")
        if positions is not None and positions < self.block_size:
            raise ValueError(f"model.max_position_embeddings={positions} < task.block_size={self.block_size}")
        return hydra.utils.instantiate(self.model_cfg, vocab_size=self.tokenizer.vocab_size)

    def train_batch(self, indices, generator):
        starts = indices * self.block_size
        if self.random_offset:
            starts = starts + torch.randint(0, self.block_size, (len(indices),), generator=generator, device="cpu")
        blocks = self.train_ids[starts[:, None] + torch.arange(self.block_size + 1, device="cpu")].long()
        return blocks[:, :-1], blocks[:, 1:]

    def per_example_loss(self, model, inputs, targets):
        logits = model(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)

    def measure(self, model: nn.Module, split: str, indices: torch.Tensor) -> dict[str, float]:
        """Mean token loss over the non-overlapping blocks `indices` of the split."""
        ids, total, device = self.split_ids(split), 0.0, model_device(model)
        for batch in indices.split(self.eval_batch_size):
            offsets = torch.arange(self.block_size + 1, device="cpu")
            blocks = ids[batch[:, None] * self.block_size + offsets].long().to(device)
            total += self.per_example_loss(model, blocks[:, :-1], blocks[:, 1:]).sum().item()
        loss = total / len(indices)
        return {"loss": loss, "perplexity": math.exp(loss)}

    def references(self) -> dict[str, float]:
        return {"unigram_entropy": self.unigram_entropy}

    def fewshot(self, model: nn.Module, tasks: list[str], num_fewshot: int, limit: int | None = None,
                batch_size: int = 16) -> dict[str, float]:
        """Few-shot accuracy through lm-eval (`distlion.tasks.fewshot`); local tasks read the test text."""
        from distlion.tasks.fewshot import evaluate_fewshot

        if not hasattr(self.tokenizer, "to_hf"):
            raise ValueError(f"eval.tasks needs a tokenizer lm-eval can use; task.tokenizer={self.tokenizer.kind} has "
                             "none: use task.tokenizer=bpe")
        return evaluate_fewshot(model, self.tokenizer.to_hf(), tasks, "\n\n".join(self.test_texts), num_fewshot,
                                limit, batch_size, max_length=self.block_size)

    def save_model(self, model: nn.Module, path: Path) -> None:
        save_pretrained(model, self.tokenizer, path)


def load_texts(spec: str, test_fraction: float) -> tuple[list[str], list[str]]:
    """(train documents, held-out test documents) from a folder (its `validation` files are the test split),
    a single file (its last `test_fraction`) or `hub:<id>`."""
    if is_hub_id(spec):
        return _hub_texts(hub_id(spec), test_fraction)
    path = resolve_path(spec, "text data", HOW)
    if path.is_file():
        text = "\n\n".join(_read(path))
        cut = int(len(text) * (1 - test_fraction))
        return [text[:cut]], [text[cut:]]
    splits = []
    for split in ("train", "validation"):
        files = split_files(path, split, "parquet") or split_files(path, split, "txt")
        if not files:
            raise missing_data_error(path / f"{split}.txt", f"text data ({split} split)", HOW)
        splits.append([doc for f in files for doc in _read(f)])
    return splits[0], splits[1]


def _read(path: Path) -> list[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return [path.read_text(encoding="utf-8")]


def _hub_texts(name: str, test_fraction: float) -> tuple[list[str], list[str]]:
    import datasets

    ds = datasets.load_dataset(name)
    if "validation" not in ds:  # e.g. OpenWebText ships one split
        ds = ds["train"].train_test_split(test_size=test_fraction, seed=0)
        ds["validation"] = ds.pop("test")
    return ds["train"]["text"], ds["validation"]["text"]


def carve_validation(texts: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """(train documents, validation documents): the last `fraction` of each document's characters is held
    out, so validation is contiguous text from every document (every book of a collection) and disjoint
    from the train text by position."""
    if not 0 < fraction < 1:
        raise ValueError(f"task.val_fraction={fraction} must be between 0 and 1")
    cuts = [int(len(t) * (1 - fraction)) for t in texts]
    return [t[:c] for t, c in zip(texts, cuts, strict=True)], [t[c:] for t, c in zip(texts, cuts, strict=True)]


def _exclude(train: list[str], test: list[str], indices: list[int]) -> tuple[list[str], list[str]]:
    """Both splits without the documents at `indices` (row i of each split is the same document's two parts)."""
    if len(train) != len(test) or not all(0 <= i < len(train) for i in indices):
        raise ValueError(f"task.exclude_documents={indices} needs data whose train and validation files hold the same "
                         f"documents row by row, indices below {len(train)}; this data has {len(train)} train and "
                         f"{len(test)} validation documents")
    keep = [i for i in range(len(train)) if i not in set(indices)]
    return [train[i] for i in keep], [test[i] for i in keep]


def _truncate(texts: list[str], max_chars: int) -> list[str]:
    out, left = [], max_chars
    for t in texts:
        if left <= 0:
            break
        out.append(t[:left])
        left -= len(out[-1])
    return out
