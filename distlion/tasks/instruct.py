"""Instruction tuning: examples with `instruction` / `input` / `output` fields (the Alpaca schema), formatted with
Alpaca's prompt template, the loss on the response tokens only (the prompt's targets are masked), as instruction
tuning does. Usually from a pretrained model (`model=llama_pretrained`), whose tokenizer it keeps.

Data (`task.data`): a .json (a list of records), .jsonl or .parquet file, or a folder with `train` and `test`
files of those kinds, resolved against `$DISTLION_DATA`; or `hub:<id>` when online (e.g. `hub:tatsu-lab/alpaca`).
Splits: the data's test file, else the last `test_fraction` of the records; validation = `val_fraction` of the
rest, drawn with `split_seed`. An example is the prompt and the response with an end-of-text token, cut at
`block_size + 1` tokens; one whose prompt leaves no response token in that length is dropped (counted in `splits`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from torch import nn

from distlion.tasks.base import Metric, Task, model_device, split_metrics
from distlion.tasks.data import hub_id, is_hub_id, missing_data_error, resolve_path
from distlion.tasks.lm import pretrained_of, save_pretrained
from distlion.tasks.tokenizer import PretrainedTokenizer, build_tokenizer

HOW = ("a .json / .jsonl / .parquet file of records with instruction, input and output fields (the Alpaca schema), "
       "or a folder with train and test files of them")
IGNORE = -100  # a target the loss skips (prompt and padding)
PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                   "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
FIELDS = ("instruction", "input", "output")


def format_prompt(record: dict[str, str]) -> str:
    """Alpaca's template, with or without its input section."""
    template = PROMPT if record.get("input") else PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=record.get("input", ""))


def load_records(spec: str, test_fraction: float) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train records, test records) of `task.data`."""
    if is_hub_id(spec):
        import datasets

        data = datasets.load_dataset(hub_id(spec))
        train = list(data["train"])
        test = list(data["test"]) if "test" in data else None
    else:
        path = resolve_path(spec, "instruction data", HOW)
        files = [path] if path.is_file() else None
        if files is None:
            train_files = sorted(f for f in path.iterdir() if f.stem.split("-")[0] == "train")
            test_files = sorted(f for f in path.iterdir() if f.stem.split("-")[0] == "test")
            if not train_files:
                raise missing_data_error(path / "train.json", "instruction data (train split)", HOW)
            train = [r for f in train_files for r in _read(f)]
            test = [r for f in test_files for r in _read(f)] or None
        else:
            train, test = _read(path), None
    for record in train[:1] + (test or [])[:1]:
        missing = [f for f in ("instruction", "output") if f not in record]
        if missing:
            raise ValueError(f"task.data={spec}: records lack {missing}; expected the fields {FIELDS}")
    if test is None:
        cut = len(train) - max(1, int(len(train) * test_fraction))
        train, test = train[:cut], train[cut:]
    return train, test


def _read(path: Path) -> list[dict[str, str]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


class InstructionTask(Task):
    """Response-token loss (nats/token) and perplexity of each held-out split."""

    metrics = split_metrics((Metric("loss", "{} response loss (nats/token)", "test", higher_is_better=False),
                             Metric("perplexity", "{} response perplexity", "test", higher_is_better=False)))
    objective = "val_loss"

    def __init__(self, model: Any, data: str, block_size: int = 256, tokenizer: str = "bpe", vocab_size: int = 1024,
                 val_fraction: float = 0.1, test_fraction: float = 0.1, split_seed: int = 0,
                 val_examples: int | None = None, eval_batch_size: int = 16):
        super().__init__(model)
        self.block_size = block_size
        self.val_examples = val_examples
        self.eval_batch_size = eval_batch_size
        if not 0 < val_fraction < 1:
            raise ValueError(f"task.val_fraction={val_fraction} must be between 0 and 1")
        source = pretrained_of(model)
        train, test = load_records(data, test_fraction)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(split_seed), device="cpu").tolist()
        num_val = max(1, int(len(train) * val_fraction))
        val = [train[i] for i in sorted(order[:num_val])]
        train = [train[i] for i in sorted(order[num_val:])]
        self.tokenizer = (PretrainedTokenizer(source) if source else build_tokenizer(
            tokenizer, vocab_size, [format_prompt(r) + r["output"] for r in train]))
        self.examples = {}
        self.dropped = {}
        for split, records in (("train", train), ("validation", val), ("test", test)):
            self.examples[split], self.dropped[split] = self.encode(records)
            if len(self.examples[split][0]) == 0:
                raise ValueError(f"no {split} example has a response token within task.block_size={block_size}; "
                                 "raise it")
        self.tokens_per_example = block_size
        self.test_text = "\n\n".join(format_prompt(r) + r["output"] for r in test)  # what local few-shot tasks read

    def encode(self, records: list[dict[str, str]]) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """(inputs, targets) [n, block_size]: targets are the next tokens of the response (and its end-of-text),
        IGNORE over the prompt and the padding. Returns them and how many records were dropped."""
        eot, length = self.tokenizer.eot_id, self.block_size + 1
        prompts = self.tokenizer.encode([format_prompt(r) for r in records])
        responses = self.tokenizer.encode([r["output"] for r in records])
        inputs, targets, dropped = [], [], 0
        for prompt, response in zip(prompts, responses, strict=True):
            if len(prompt) >= length:  # not one response token left
                dropped += 1
                continue
            sequence = (prompt + response + [eot])[:length]
            labels = [IGNORE] * len(prompt) + sequence[len(prompt):]
            pad = length - len(sequence)
            inputs.append(sequence[:-1] + [eot] * pad)
            targets.append(labels[1:] + [IGNORE] * pad)
        shape = (len(inputs), self.block_size)
        return (torch.tensor(inputs, dtype=torch.long, device="cpu").view(shape),
                torch.tensor(targets, dtype=torch.long, device="cpu").view(shape)), dropped

    @property
    def num_train(self) -> int:
        return len(self.examples["train"][0])

    @property
    def splits(self) -> dict[str, Any]:
        return {split: len(x) for split, (x, _) in self.examples.items()} | {
            "unit": "instruction examples", "dropped_prompt_too_long": self.dropped}

    def build_model(self) -> nn.Module:
        return hydra.utils.instantiate(self.model_cfg, vocab_size=self.tokenizer.vocab_size)

    def train_batch(self, indices, generator):
        inputs, targets = self.examples["train"]
        return inputs[indices], targets[indices]

    def per_example_loss(self, model, inputs, targets):
        """Mean cross-entropy over each example's response tokens (its prompt and padding are IGNORE)."""
        logits = model(input_ids=inputs, use_cache=False).logits
        nats = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
        return nats.sum(dim=1) / (targets != IGNORE).sum(dim=1)

    def measure(self, model: nn.Module, split: str, indices: torch.Tensor) -> dict[str, float]:
        """Response-token loss over the examples `indices`, weighted by tokens (as one long response)."""
        inputs, targets = self.examples[split]
        nats, tokens, device = 0.0, 0, model_device(model)
        for batch in indices.split(self.eval_batch_size):
            x, y = inputs[batch].to(device), targets[batch].to(device)
            logits = model(input_ids=x, use_cache=False).logits
            nats += F.cross_entropy(logits.transpose(1, 2), y, ignore_index=IGNORE, reduction="sum").item()
            tokens += int((y != IGNORE).sum())
        loss = nats / tokens
        return {"loss": loss, "perplexity": math.exp(loss)}

    def fewshot(self, model: nn.Module, tasks: list[str], num_fewshot: int, limit: int | None = None,
                batch_size: int = 16) -> dict[str, float]:
        """Few-shot accuracy through lm-eval (`distlion.tasks.fewshot`): the paper's tasks by their lm-eval names
        (their data from the Hugging Face cache), or the local tasks on the held-out instructions and responses."""
        from distlion.tasks.fewshot import evaluate_fewshot

        if not hasattr(self.tokenizer, "to_hf"):
            raise ValueError(f"eval.tasks needs a tokenizer lm-eval can use; task.tokenizer={self.tokenizer.kind} has "
                             "none: use task.tokenizer=bpe or a pretrained model's")
        return evaluate_fewshot(model, self.tokenizer.to_hf(), tasks, self.test_text, num_fewshot, limit, batch_size,
                                max_length=self.block_size)

    def save_model(self, model: nn.Module, path: Path) -> None:
        save_pretrained(model, self.tokenizer, path)
