"""Issue 38: `distlion-experiment SPEC --estimate` counts a spec's runs and their steps as the runner makes them, and
times a step on the device at hand; a model too large for it is timed at a reduced depth and scaled, and says so."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import distlion.estimate as estimate_module
import distlion.tasks.data as data_module
from distlion.config import validate
from distlion.estimate import estimate, plan, run_points, spec_sections, stand_in, time_worker
from distlion.tasks.fewshot import PAPER_TASKS
from distlion.train import build_run
from distlion.tuning import parse_tuning

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
DIGITS_TRAIN = 1077  # digits' training split (tests/test_splits.py)

SPEC = """
name: tiny_estimate
base: [task=digits, cluster.per_worker_batch=8, train.epochs=3]
sweeps:
  - method=dlion,adamw cluster.workers=2,4
seeds: [0, 1, 2]
tuning:
  objective: validation
  budget: {train.epochs: 1}
  sweep: cluster.workers=2
  seeds: [0]
  grid_points_per_decade: 1
  spaces:
    adamw: {lr: [1e-3, 1e-2]}
"""


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(data_module.CACHE_ENV, str(tmp_path / "cache"))


def steps_by_hand(workers: int, batch: int, epochs: float) -> int:
    """The sampler's arithmetic: each worker's shard of the training split, whole batches per epoch."""
    return math.ceil(epochs * ((DIGITS_TRAIN // workers) // batch))


def test_the_estimate_counts_the_runs_and_steps_the_runner_makes(tmp_path, make_cfg):
    spec = yaml.safe_load(SPEC)
    result = estimate(spec, parse_tuning(spec), ["logger=none", "train.device=cpu"], CONF, tmp_path / "runs")
    assert result.sections == ["tuning", "final"]
    assert result.runs("tuning") == 2 and result.runs("final") == 2 * 2 * 3  # adamw's 2 lrs; methods x N x seeds
    final = {(r.group.split("N=")[1].split(" ")[0], r.group.rsplit(", ", 1)[1]): r
             for r in result.rows if r.section == "final"}
    assert set(final) == {("2", "G-AdamW"), ("2", "D-Lion (MaVo)"), ("4", "G-AdamW"), ("4", "D-Lion (MaVo)")}
    for (workers, _), row in final.items():
        assert row.runs == 3 and row.steps == steps_by_hand(int(workers), 8, 3)
        assert row.hours == pytest.approx(3 * row.steps * row.seconds / 3600) and row.seconds > 0
    cfg = make_cfg("task=digits", "cluster.per_worker_batch=8", "train.epochs=3", "cluster.workers=4")
    assert final[("4", "G-AdamW")].steps == build_run(cfg, validate(cfg)).steps  # the runner's own count
    [trials] = [r for r in result.rows if r.section == "tuning"]
    assert trials.runs == 2 and trials.steps == steps_by_hand(2, 8, 1)  # the tuning budget: one epoch
    # N workers' gradients cost N times one worker's, plus the method's step.
    [(what, worker)] = result.timings
    assert what == "digits / vit_digits (8)"
    assert final[("4", "G-AdamW")].seconds > 4 * worker.seconds > final[("2", "G-AdamW")].seconds - worker.seconds
    assert result.hours() == pytest.approx(sum(r.hours for r in result.rows))


def test_a_model_that_does_not_fit_is_timed_at_two_depths_and_extrapolated_linearly(make_cfg, monkeypatch):
    cfg = make_cfg("task=digits", "cluster.per_worker_batch=8")
    planned = plan(cfg, validate(cfg))
    assert planned.shape.depth == 3 and planned.shape.depth_key == "depth"  # vit_digits: 3 blocks
    timed_depths = []

    def worker_step(task, cfg, indices, depth, depth_key, device):  # a model of 0.1 s + 0.2 s per block for 8
        timed_depths.append(depth)
        return lambda size: (depth or 3, size)

    def timed(step, device, repeats=2, budget=None):
        depth, size = step
        return (0.1 + 0.2 * depth) * size / 8

    monkeypatch.setattr(estimate_module, "worker_step", worker_step)
    monkeypatch.setattr(estimate_module, "timed", timed)
    reduced = time_worker(planned, cfg, torch.device("cpu"), memory=0)
    assert timed_depths == [2, 1] and reduced.seconds == pytest.approx(0.1 + 0.2 * 3)
    assert "depths 2 and 1 of 3 timed, scaled linearly in depth" in reduced.how and "GiB at hand" in reduced.how
    full = time_worker(planned, cfg, torch.device("cpu"), memory=2**40)
    assert timed_depths[2:] == [None] and full.how == "measured"


def estimate_command(spec: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distlion.experiment", str(spec), "--estimate", "logger=none",
                           "train.device=cpu", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_command_prints_the_table_and_says_when_it_reduced_the_depth(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(SPEC.replace("seeds: [0, 1, 2]", "seeds: [0]").replace("dlion,adamw", "dlion"))
    done = estimate_command(spec, "--memory", "1e-6")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "# Estimate: tiny_estimate on cpu" in done.stdout
    row = next(line for line in done.stdout.splitlines() if "D-Lion (MaVo)" in line)
    cells = [cell.strip() for cell in row.strip("| ").split("|")]
    assert cells[:4] == ["final", "digits / vit_digits, N=2 x 8, D-Lion (MaVo)", "1", str(steps_by_hand(2, 8, 3))]
    assert "depths 2 and 1 of 3 timed, scaled linearly in depth" in done.stdout
    assert "**total**" in done.stdout and not list(tmp_path.glob("runs"))  # nothing was run or written


def test_absent_data_is_the_loaders_one_error_line(tmp_path):
    spec = tmp_path / "cifar.yaml"
    spec.write_text(f"name: cifar\nbase: [task=cifar10, model=vit_cifar_cpu, task.data={tmp_path / 'nowhere'}]\n"
                    "sweeps: [method=dlion]\n")
    done = estimate_command(spec)
    assert done.returncode == 1 and "| " not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("distlion: error: cifar: CIFAR-10") and f"not found at {tmp_path / 'nowhere'}" in last


PAPER_RUNS = {"cifar10_workers": 7 * 4 * 3, "cifar10_bits": 7 * 3, "imagenet_vit": 2 * 4, "lm_table": 4,
              "lm_finetune_paper": 4}


@pytest.mark.parametrize("name", sorted(PAPER_RUNS))
def test_the_paper_specs_expand_into_their_runs(name, tmp_path):
    spec = yaml.safe_load((REPO / "experiments" / f"{name}.yaml").read_text())
    sections, _ = spec_sections(spec, None, tmp_path)
    [(section, final)] = sections
    points = run_points(final, ["logger=none"])
    assert section == "final" and len(points) == PAPER_RUNS[name]
    if name == "lm_finetune_paper":  # a 7B LLaMA, instruction data, the paper's 3-shot tasks by lm-eval name
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfgs = [compose("config", overrides=p) for p in points]
        assert {c.method.name for c in cfgs} == {"adamw", "lion", "dlion"} and len(cfgs) == 4
        for cfg in cfgs:
            assert cfg.task.name == "instruct" and cfg.model.pretrained == "hub:huggyllama/llama-7b"
            assert tuple(cfg.eval.tasks) == PAPER_TASKS and cfg.eval.num_fewshot == 3


def test_a_pretrained_llama_is_planned_and_timed_from_its_config_alone(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    config.save_pretrained(tmp_path)  # config.json only: no weights, no tokenizer
    full = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    planned = stand_in("distlion.estimate.llama_architecture", pretrained=str(tmp_path), vocab_size=300)
    assert sum(p.numel() for p in planned.parameters()) == 2  # what build_run flattens and binds a cluster to
    assert planned.shape.numel == full and planned.shape.depth == 6 and planned.shape.depth_key == "num_hidden_layers"
    assert planned.config.max_position_embeddings == 64  # the task's check of its positions reads it
    reduced = estimate_module.llama_architecture(str(tmp_path), vocab_size=280, num_hidden_layers=2)
    assert reduced.config.num_hidden_layers == 2 and reduced.config.vocab_size == 300
    with pytest.raises(ValueError, match="300 token embeddings, fewer than its tokenizer's 320"):
        estimate_module.llama_architecture(str(tmp_path), vocab_size=320)  # as load_llama refuses it


def test_a_torchrun_spec_counts_every_rank_a_device(tmp_path):
    """lm_finetune_paper's shape at toy size: a pretrained LLaMA from a folder, instruction data, 8 ranks."""
    from transformers import LlamaConfig

    from distlion.tasks.tokenizer import build_tokenizer

    records = [{"instruction": f"Repeat the word {w}.", "input": "", "output": f"{w} {w}"}
               for w in ["red", "green", "blue", "black", "white"] * 24]
    (tmp_path / "alpaca.json").write_text(json.dumps(records))
    model = tmp_path / "llama"
    tokenizer = build_tokenizer("bpe", 280, [r["instruction"] + r["output"] for r in records])
    tokenizer.to_hf().save_pretrained(model)
    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=512).save_pretrained(model)
    spec = yaml.safe_load((REPO / "experiments" / "lm_finetune_paper.yaml").read_text())
    extra = ["logger=none", "train.device=cpu", f"task.data={tmp_path / 'alpaca.json'}", f"model.pretrained={model}",
             "eval.tasks=[]"]  # (few-shot evaluation: InstructionTask has none yet)
    result = estimate(spec, None, extra, CONF, tmp_path / "runs")
    assert result.runs() == 4 and {r.devices for r in result.rows} == {8}
    train = len(records) - len(records) // 10  # the last 10% are the test split
    train -= int(train * 0.1)  # and 10% of the rest validation
    assert {r.steps for r in result.rows} == {3 * ((train // 8) // 4)}
    assert all(", N=8 ranks x 4, " in r.group and "llama_pretrained" in r.group for r in result.rows)


def test_a_step_over_the_budget_is_timed_on_a_micro_batch_and_scaled_linearly(make_cfg, monkeypatch):
    cfg = make_cfg("task=digits", "cluster.per_worker_batch=32")
    planned = plan(cfg, validate(cfg))
    per_example = estimate_module.BUDGET_S / 5  # 32 examples take 6.4 budgets: 4 fit in one
    monkeypatch.setattr(estimate_module, "worker_step", lambda *args: lambda size: size)
    monkeypatch.setattr(estimate_module, "timed", lambda size, device, repeats=2, budget=None: per_example * size)
    timing = time_worker(planned, cfg, torch.device("cpu"), memory=2**40)
    assert timing.seconds == pytest.approx(32 * per_example) and timing.how == "micro-batch 4 of 32, x8"
