"""LLaMA-style causal language modelling on contiguous token blocks.

Model: `transformers.LlamaForCausalLM` (RMSNorm, RoPE, SwiGLU), random init, built by `build_llama`
with the tokenizer's vocabulary size. Data: `task.data` is a folder holding `<split>-*.parquet`
(a `text` column, one document per row) or `<split>.txt` for the splits `train` and `validation`
(Tiny Shakespeare and the Gutenberg books in `$DISTLION_DATA/text/`), a single .txt/.parquet file (its
last `val_fraction` becomes validation), or `hub:<id>` (e.g. `hub:Skylion007/openwebtext`) when online.

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

from distlion.tasks.base import Metric, Task
from distlion.tasks.data import (
    atomic_save,
    cache_dir,
    hub_id,
    is_hub_id,
    missing_data_error,
    resolve_path,
    split_files,
)
from distlion.tasks.tokenizer import build_tokenizer, text_digest

HOW = ("a folder with train/validation .txt or Parquet files with a `text` column, e.g. Tiny Shakespeare "
       "from https://github.com/karpathy/char-rnn (data/tinyshakespeare/input.txt)")


def build_llama(vocab_size: int, **config: Any) -> nn.Module:
    """A randomly initialised `LlamaForCausalLM` from `LlamaConfig(**config)`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **config))


class LanguageModelTask(Task):
    """Next-token prediction; metric: validation loss (nats/token), also perplexity = exp(loss).

    `unigram_entropy` (nats/token of the tokenizer's training data) is the loss of the best model that
    ignores context: the reference line a trained model must fall well below.
    """

    metrics = (
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
        random_offset: bool = True,
        eval_blocks: int | None = 64,
        eval_batch_size: int = 16,
    ):
        super().__init__(model)
        self.block_size = block_size
        self.random_offset = random_offset
        self.eval_batch_size = eval_batch_size
        train_texts, val_texts = load_texts(data, val_fraction)
        if max_chars is not None:
            train_texts, val_texts = _truncate(train_texts, max_chars), _truncate(val_texts, max_chars)
        self.tokenizer = build_tokenizer(tokenizer, vocab_size, train_texts)
        self.train_ids = self._token_ids(train_texts)
        self.val_ids = self._token_ids(val_texts)
        counts = torch.bincount(self.train_ids.long(), minlength=self.tokenizer.vocab_size).double()
        p = counts[counts > 0] / counts.sum()
        self.unigram_entropy = float(-(p * p.log()).sum())
        #: Tokens each example contributes (the runner's tokens/s = examples/s * this).
        self.tokens_per_example = block_size
        num_val = (len(self.val_ids) - 1) // block_size
        self.num_eval_blocks = num_val if eval_blocks is None else min(eval_blocks, num_val)
        # A random start offset needs one block of slack at the end of the text.
        self._num_train = (len(self.train_ids) - 1) // block_size - int(random_offset)
        if self._num_train < 1 or self.num_eval_blocks < 1:
            raise ValueError(f"the text is too short for task.block_size={block_size}: "
                             f"{len(self.train_ids)} train / {len(self.val_ids)} validation tokens; "
                             "lower block_size or raise max_chars")

    @property
    def num_train(self) -> int:
        return self._num_train

    def _token_ids(self, texts: list[str]) -> torch.Tensor:
        """Token ids of the documents joined by end-of-text, cached by tokenizer and text."""
        path = cache_dir("tokens") / f"{self.tokenizer.key}-{text_digest(texts)}.pt"
        if path.exists():
            return torch.load(path)
        ids = []
        for doc in self.tokenizer.encode(texts):
            ids.extend(doc)
            ids.append(self.tokenizer.eot_id)
        tensor = torch.tensor(ids, dtype=torch.int32)
        atomic_save(tensor, path)
        return tensor

    def build_model(self) -> nn.Module:
        positions = self.model_cfg.get("max_position_embeddings")
        if positions is not None and positions < self.block_size:
            raise ValueError(f"model.max_position_embeddings={positions} < task.block_size={self.block_size}")
        return hydra.utils.instantiate(self.model_cfg, vocab_size=self.tokenizer.vocab_size)

    def train_batch(self, indices, generator):
        starts = indices * self.block_size
        if self.random_offset:
            starts = starts + torch.randint(0, self.block_size, (len(indices),), generator=generator)
        blocks = self.train_ids[starts[:, None] + torch.arange(self.block_size + 1)].long()
        return blocks[:, :-1], blocks[:, 1:]

    def per_example_loss(self, model, inputs, targets):
        logits = model(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Mean token loss over the first `eval_blocks` non-overlapping validation blocks."""
        was_training = model.training
        model.eval()
        total = 0.0
        for start in range(0, self.num_eval_blocks, self.eval_batch_size):
            index = torch.arange(start, min(start + self.eval_batch_size, self.num_eval_blocks))
            blocks = self.val_ids[index[:, None] * self.block_size + torch.arange(self.block_size + 1)].long()
            total += self.per_example_loss(model, blocks[:, :-1], blocks[:, 1:]).sum().item()
        model.train(was_training)
        loss = total / self.num_eval_blocks
        return {"eval_loss": loss, "eval_perplexity": math.exp(loss), "unigram_entropy": self.unigram_entropy}


def load_texts(spec: str, val_fraction: float) -> tuple[list[str], list[str]]:
    """(train documents, validation documents) from a folder, a single file or `hub:<id>`."""
    if is_hub_id(spec):
        return _hub_texts(hub_id(spec), val_fraction)
    path = resolve_path(spec, "text data", HOW)
    if path.is_file():
        text = "\n\n".join(_read(path))
        cut = int(len(text) * (1 - val_fraction))
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


def _hub_texts(name: str, val_fraction: float) -> tuple[list[str], list[str]]:
    import datasets

    ds = datasets.load_dataset(name)
    if "validation" not in ds:  # e.g. OpenWebText ships one split
        ds = ds["train"].train_test_split(test_size=val_fraction, seed=0)
        ds["validation"] = ds.pop("test")
    return ds["train"]["text"], ds["validation"]["text"]


def _truncate(texts: list[str], max_chars: int) -> list[str]:
    out, left = [], max_chars
    for t in texts:
        if left <= 0:
            break
        out.append(t[:left])
        left -= len(out[-1])
    return out
