"""Issue 16: the instruction-tuning task (Alpaca schema), its prompt masking and an end-to-end run."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_tasks import TINY_LLAMA

import distlion.tasks.data as data_module
from distlion.tasks import build_task
from distlion.tasks.instruct import IGNORE, format_prompt
from distlion.train import run

COLOURS = ["red", "green", "blue", "yellow", "black", "white"]


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(data_module.CACHE_ENV, str(tmp_path / "cache"))


@pytest.fixture
def alpaca(tmp_path):
    """60 records: name the colour after a word (with an input) or repeat a word (without)."""
    records = []
    for i in range(60):
        colour = COLOURS[i % len(COLOURS)]
        if i % 2:
            records.append({"instruction": "Name the colour in the input.", "input": f"the {colour} house",
                            "output": colour})
        else:
            records.append({"instruction": f"Repeat the word {colour} twice.", "input": "",
                            "output": f"{colour} {colour}"})
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(records))
    return path, records


def test_examples_mask_the_prompt_and_the_loss_reads_only_response_tokens(make_cfg, alpaca):
    path, records = alpaca
    cfg = make_cfg("task=instruct", *TINY_LLAMA, f"task.data={path}", "task.vocab_size=270", "task.block_size=256")
    task = build_task(cfg.task, cfg.model)
    assert task.splits["train"] + task.splits["validation"] + task.splits["test"] == 60
    assert task.splits["test"] == 6  # the last 10% of the records

    # Hand-built: the first test record (record 54, no input) as prompt + response + end-of-text.
    record = records[54]
    prompt = task.tokenizer.encode([format_prompt(record)])[0]
    response = task.tokenizer.encode([record["output"]])[0] + [task.tokenizer.eot_id]
    inputs, targets = (t[0] for t in task.examples["test"])
    sequence = prompt + response
    assert inputs[: len(sequence) - 1].tolist() == sequence[:-1]
    assert targets[: len(prompt) - 1].tolist() == [IGNORE] * (len(prompt) - 1)
    assert targets[len(prompt) - 1 : len(sequence) - 1].tolist() == response
    assert (targets[len(sequence) - 1 :] == IGNORE).all()

    model = task.build_model().eval()
    x, y = task.examples["test"][0][:2], task.examples["test"][1][:2]
    with torch.no_grad():
        losses = task.per_example_loss(model, x, y)
        logits = model(input_ids=x).logits
    for row in range(2):
        kept = (y[row] != IGNORE).nonzero().flatten()
        by_hand = -F.log_softmax(logits[row, kept], dim=-1)[torch.arange(len(kept)), y[row, kept]].mean()
        assert losses[row] == pytest.approx(by_hand.item(), rel=1e-5)


def test_instruction_tuning_runs_and_learns(make_cfg, alpaca, tmp_path):
    path, _ = alpaca
    summary = run(make_cfg("task=instruct", *TINY_LLAMA, f"task.data={path}", "task.vocab_size=270",
                           "task.block_size=256", "method=dlion", "method.lr=3e-3", "cluster.workers=2",
                           "cluster.per_worker_batch=4", "train.steps=30", "train.eval_every=10",
                           "schedule.warmup_steps=3"), tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [m["val_loss"] for m in lines if "val_loss" in m]
    assert evals[-1] < evals[0] - 0.5
    assert summary["splits"]["unit"] == "instruction examples" and summary["test_loss"] > 0


def test_records_without_the_fields_are_one_clear_error(make_cfg, tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    cfg = make_cfg("task=instruct", *TINY_LLAMA, f"task.data={tmp_path / 'bad.jsonl'}")
    with pytest.raises(Exception) as err:
        build_task(cfg.task, cfg.model)
    assert "records lack ['instruction', 'output']" in str(err.value.__cause__ or err.value)


def test_an_instruction_run_ends_with_few_shot_scores(make_cfg, alpaca, tmp_path):
    """The paper's finetuning table scores its models 3-shot through lm-eval (lm-eval's task names need their data in
    the Hugging Face cache; the local tasks read the held-out instructions and responses)."""
    _, records = alpaca
    path = tmp_path / "more.json"
    path.write_text(json.dumps(records * 4))  # a local task needs 42 passages of held-out text
    summary = run(make_cfg("task=instruct", *TINY_LLAMA, f"task.data={path}", "task.vocab_size=270",
                           "task.block_size=256", "task.test_fraction=0.5", "cluster.workers=2",
                           "cluster.per_worker_batch=4", "train.steps=2", "eval.tasks=[lastword]", "eval.limit=6",
                           "eval.num_fewshot=3"), tmp_path / "run")
    assert summary["fewshot_acc_lastword"] in {k / 6 for k in range(7)} and summary["fewshot_chance_lastword"] > 0
