"""Issue 16: few-shot evaluation through lm-eval, on local tasks built from held-out text."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest
from test_tasks import TINY_LLAMA, needs_data

import distlion.tasks.data as data_module
from distlion.config import ConfigError
from distlion.tasks import build_task
from distlion.tasks.data import data_root
from distlion.tasks.fewshot import CHOICES, PAPER_TASKS, POOL, lastword_docs, local_task_config, nextline_docs
from distlion.train import run

SHAKESPEARE = "text/tinyshakespeare"


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(data_module.CACHE_ENV, str(tmp_path / "cache"))


def shakespeare(split: str) -> str:
    return (data_root() / SHAKESPEARE / f"{split}.txt").read_text()


@needs_data
@pytest.mark.parametrize("name", ["nextline", "lastword"])
def test_local_tasks_are_built_identically_twice_and_share_no_passage_with_the_training_text(name, tmp_path,
                                                                                            monkeypatch):
    held_out, train = shakespeare("validation"), shakespeare("train")
    lines_of = lambda text: "\n".join(line.rstrip() for line in text.splitlines() if line.strip())  # noqa: E731
    first = local_task_config(name, held_out)
    files = {split: open(path).read() for split, path in first["dataset_kwargs"]["data_files"].items()}
    monkeypatch.setenv(data_module.CACHE_ENV, str(tmp_path / "other"))  # built again from nothing
    second = local_task_config(name, held_out)
    assert {split: open(path).read() for split, path in second["dataset_kwargs"]["data_files"].items()} == files
    docs = {split: [json.loads(line) for line in text.splitlines()] for split, text in files.items()}
    assert len(docs["train"]) == POOL and len(docs["test"]) > 400
    passages = [d["context"] for d in docs["train"] + docs["test"]]
    assert len(set(passages)) == len(passages)  # few-shot pool and scored passages are disjoint
    for doc in docs["train"] + docs["test"]:
        assert len(doc["choices"]) == len(set(doc["choices"])) == CHOICES and 0 <= doc["label"] < CHOICES
        answer = doc["choices"][doc["label"]]
        joined = doc["context"] + ("\n" if name == "nextline" else " ") + answer
        assert joined in lines_of(held_out)  # a passage of the held-out text, its answer where it belongs
        assert joined not in lines_of(train)  # and never in the training text
    labels = [d["label"] for d in docs["test"]]
    assert max(labels.count(k) for k in range(CHOICES)) < 0.35 * len(labels)  # the answer's position is shuffled


@needs_data
@pytest.mark.parametrize("name", ["nextline", "lastword"])
def test_a_scorer_blind_to_the_context_is_at_chance(name):
    # An untrained model's likelihood follows the token count, i.e. how common a word is; distractors drawn from
    # the distinct words (rare ones as often as common ones) let the most common candidate win 52% of `lastword`.
    build = {"nextline": nextline_docs, "lastword": lastword_docs}[name]
    docs = build(shakespeare("validation"))
    counts = Counter(re.findall(r"[A-Za-z]+", shakespeare("train")))
    blind_scores = {"most common words": lambda c: sum(counts[w] for w in re.findall(r"[A-Za-z]+", c)) / len(c),
                    "rarest words": lambda c: -sum(counts[w] for w in re.findall(r"[A-Za-z]+", c)) / len(c),
                    "longest": len, "shortest": lambda c: -len(c)}
    ceiling = 1 / CHOICES + 3 * math.sqrt((1 / CHOICES) * (1 - 1 / CHOICES) / len(docs))  # chance + 3 stderr
    for rule, score in blind_scores.items():
        picks = [max(range(CHOICES), key=lambda k: score(d["choices"][k])) for d in docs]
        accuracy = sum(p == d["label"] for p, d in zip(picks, docs)) / len(docs)
        assert accuracy < ceiling, f"{name}: picking the {rule} candidate scores {accuracy:.3f}"


def test_the_builders_hand_checked_on_a_small_text():
    text = "\n".join(f"line number {i:03d} of the play, said the speaker" for i in range(200))
    docs = nextline_docs(text)
    assert docs[0]["context"] == "\n".join(f"line number {i:03d} of the play, said the speaker" for i in range(4))
    assert docs[0]["choices"][docs[0]["label"]] == "line number 004 of the play, said the speaker"
    words = lastword_docs("Alpha bravo charlie\n" * 30 + "delta echo Foxtrot\nGolf Hotel Indigo\nJuliet Kilo Lima\n")
    assert all(d["choices"][d["label"]] in {"charlie", "Lima"} for d in words)


@needs_data
def test_a_run_ends_with_few_shot_scores_through_lm_eval(make_cfg, tmp_path):
    summary = run(make_cfg("task=shakespeare", *TINY_LLAMA, "task.max_chars=20000", "task.block_size=64",
                           "task.vocab_size=300", "task.val_examples=8", "method=dlion", "method.lr=1e-3",
                           "cluster.workers=2", "cluster.per_worker_batch=4", "train.steps=4",
                           "eval.tasks=[nextline,lastword]", "eval.limit=20", "eval.num_fewshot=3"),
                  tmp_path / "run")
    for name in ("nextline", "lastword"):
        acc, stderr = summary[f"fewshot_acc_{name}"], summary[f"fewshot_acc_stderr_{name}"]
        assert acc in {k / 20 for k in range(21)}  # 20 scored examples
        assert stderr == pytest.approx((acc * (1 - acc) / 19) ** 0.5)  # lm-eval's sample stderr of a mean
        assert summary[f"fewshot_chance_{name}"] == 1 / CHOICES
        assert 0 <= summary[f"fewshot_acc_norm_{name}"] <= 1


def test_few_shot_tasks_are_refused_for_a_task_that_is_no_language_model(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"eval.tasks=\['nextline'\]: few-shot evaluation is for LM tasks"):
        run(make_cfg("eval.tasks=[nextline]", "train.steps=1"), tmp_path / "digits")


@needs_data
def test_an_unknown_or_unavailable_task_is_one_clear_error(make_cfg, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = make_cfg("task=shakespeare", *TINY_LLAMA, "task.max_chars=20000", "task.block_size=64",
                   "task.vocab_size=300")
    task = build_task(cfg.task, cfg.model)
    model = task.build_model()
    with pytest.raises(ValueError, match="few-shot task 'no_such_task' is neither local"):
        task.fewshot(model, ["no_such_task"], 0)
    with pytest.raises(FileNotFoundError, match="few-shot task arc_easy: its data set could not be loaded"):
        task.fewshot(model, ["arc_easy"], 0, limit=2)


def test_the_papers_tasks_are_lm_eval_task_names():
    from lm_eval.tasks import TaskManager

    assert set(PAPER_TASKS) <= set(TaskManager().all_tasks)
