"""Issue 16: a run saves its LM with `save_pretrained`, the next one finetunes it (`model.pretrained`)."""

from __future__ import annotations

import json

import pytest
import torch
from test_tasks import TINY_LLAMA, needs_data
from transformers import AutoTokenizer

import distlion.tasks.data as data_module
from distlion.config import ConfigError, validate
from distlion.flat import FlatParams
from distlion.tasks import build_task
from distlion.tasks.lm import load_llama
from distlion.train import build_run, params_digest, run

PRETRAIN = ["task=gutenberg", *TINY_LLAMA, "task.max_chars=30000", "task.block_size=32", "task.vocab_size=300",
            "task.val_examples=16", "method=adamw", "method.lr=3e-3", "cluster.workers=2", "cluster.per_worker_batch=4",
            "train.steps=12", "train.eval_every=6"]
TEXT = "To be, or not to be, that is the Question:"


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(data_module.CACHE_ENV, str(tmp_path / "cache"))


def test_save_pretrained_then_load_gives_identical_logits_and_token_ids(make_cfg, tmp_path):
    (tmp_path / "book.txt").write_text("to be or not to be, that is the question. whether tis nobler " * 80)
    cfg = make_cfg("task=shakespeare", *TINY_LLAMA, f"task.data={tmp_path / 'book.txt'}", "task.vocab_size=280",
                   "task.block_size=16")
    task = build_task(cfg.task, cfg.model)
    model = task.build_model().eval()
    task.save_model(model, tmp_path / "saved")
    loaded = load_llama(str(tmp_path / "saved")).eval()
    ids = torch.randint(0, 280, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == task.tokenizer.encode([TEXT])[0]
    assert tokenizer.eos_token_id == task.tokenizer.eot_id


@needs_data
def test_a_pretrained_run_is_finetuned_from_its_saved_weights_and_tokenizer(make_cfg, tmp_path):
    pretrain = run(make_cfg(*PRETRAIN, "train.save_model=true"), tmp_path / "pretrain")
    saved = tmp_path / "pretrain" / pretrain["model_dir"]
    # The saved weights are the run's final ones, to the bit.
    assert params_digest(FlatParams(load_llama(str(saved)))) == pretrain["params_sha256"]

    finetune = ["task=shakespeare", "model=llama_pretrained", f"model.pretrained={saved}", "task.max_chars=20000",
                "task.block_size=32", "task.val_examples=16", "method=dlion", "method.lr=1e-3", "cluster.workers=2",
                "cluster.per_worker_batch=4", "train.steps=6", "train.eval_every=3"]
    cfg = make_cfg(*finetune)
    start = build_run(cfg, validate(cfg))
    pretrain_task = build_task(make_cfg(*PRETRAIN).task, make_cfg(*PRETRAIN).model)
    assert start.task.tokenizer.encode([TEXT]) == pretrain_task.tokenizer.encode([TEXT])  # Gutenberg's tokenizer
    assert start.flat.numel == pretrain["num_params"]
    # Before any step the model is the pretrained one: its loss on Shakespeare is far below a fresh model's.
    start_loss = start.task.evaluate(start.model, "validation")["val_loss"]
    fresh = build_run(make_cfg(*PRETRAIN[1:], *finetune[:1], *finetune[3:]), validate(cfg))
    assert start_loss < fresh.task.evaluate(fresh.model, "validation")["val_loss"] - 0.3

    done = run(cfg, tmp_path / "finetune")
    lines = [json.loads(line) for line in (tmp_path / "finetune" / "metrics.jsonl").read_text().splitlines()]
    assert [m["val_loss"] for m in lines if "val_loss" in m][-1] < start_loss
    assert done["task"] == "shakespeare" and "model_dir" not in done


def test_save_model_needs_a_task_that_can_save(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match="train.save_model=true: task digits cannot save"):
        run(make_cfg("train.save_model=true", "train.steps=1"), tmp_path / "digits")


def test_a_missing_pretrained_folder_is_one_clear_error(make_cfg, tmp_path):
    cfg = make_cfg("task=shakespeare", "model=llama_pretrained", f"model.pretrained={tmp_path / 'nothing'}")
    with pytest.raises(Exception) as err:  # hydra wraps the task's FileNotFoundError (the CLI prints the cause)
        build_task(cfg.task, cfg.model)
    cause = err.value.__cause__
    assert isinstance(cause, FileNotFoundError) and "\n" not in str(cause)
    assert f"model.pretrained={tmp_path / 'nothing'}: no config.json" in str(cause)
    assert "train.save_model=true" in str(cause)


@needs_data
def test_the_pretraining_corpus_leaves_out_exactly_the_shakespeare_plays(make_cfg):
    from omegaconf import OmegaConf

    from distlion.tasks import TASK_CONFIGS
    from distlion.tasks.lm import _exclude, load_texts

    train, test = load_texts("text/gutenberg", 0.1)
    kept_train, kept_test = _exclude(train, test, list(OmegaConf.load(TASK_CONFIGS / "gutenberg_pretrain.yaml")
                                                        .exclude_documents))
    assert len(kept_train) == len(kept_test) == 10
    assert not any("Shakespeare" in t[:100] for t in kept_train)
    assert sum("by William Shakespeare" in t[:100] for t in train) == 3
    assert kept_test == [t for t, whole in zip(test, train, strict=True) if "Shakespeare" not in whole[:100]]
    with pytest.raises(ValueError, match=r"task.exclude_documents=\[13\] needs .* indices below 13"):
        _exclude(train, test, [13])


@needs_data
def test_the_few_shot_command_scores_a_saved_model_and_its_untrained_twin(make_cfg, tmp_path):
    import subprocess
    import sys

    cfg = make_cfg("task=shakespeare", *TINY_LLAMA, "task.max_chars=20000", "task.vocab_size=300",
                   "task.block_size=64")
    task = build_task(cfg.task, cfg.model)
    task.save_model(task.build_model(), tmp_path / "saved")
    scores = {}
    for untrained in (False, True):
        out = tmp_path / f"{untrained}.json"
        subprocess.run([sys.executable, "-m", "distlion.tasks.fewshot", str(tmp_path / "saved"), "--task",
                        "shakespeare", "--tasks", "nextline", "--limit", "8", "--out", str(out),
                        *(["--untrained", "--seed", "1"] if untrained else [])], check=True, capture_output=True)
        scores[untrained] = json.loads(out.read_text())
    for result in scores.values():
        assert result["fewshot_acc_nextline"] in {k / 8 for k in range(9)} and result["fewshot_chance_nextline"] == 0.25
    assert scores[True]["untrained"] and not scores[False]["untrained"]
