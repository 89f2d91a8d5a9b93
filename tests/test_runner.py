"""The runner end to end on the digits task: it trains, logs, protects results, rejects bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from distlion.cluster.sampler import ShardedSampler
from distlion.train import run


def test_dlion_mavo_4_workers_learns_digits(make_cfg, tmp_path):
    # 45 epochs of the 1,077 training images (270 of the 1,347 are validation): 360 steps, 30 epochs were 300.
    # lr and weight decay pinned here, so that retuning conf/tuned/digits_dlion.yaml cannot change this test.
    cfg = make_cfg("method=dlion", "method.aggregation=mavo", "cluster.workers=4", "cluster.per_worker_batch=32",
                   "train.epochs=45", "method.lr=3e-3", "method.weight_decay=0.1")
    summary = run(cfg, tmp_path)
    assert summary["test_accuracy"] >= 0.90  # real evaluation on the 450 held-out test images
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == summary["steps"]
    evals = [line for line in lines if "val_accuracy" in line]
    assert len(evals) >= 10
    assert evals[-1]["val_accuracy"] > evals[0]["val_accuracy"]
    # 1 bit up + 1 bit down per parameter, plus at most 7 padding bits per message.
    assert 2.0 <= summary["bits_per_param_per_iter"] <= 2.0 + 16 / summary["num_params"]
    assert lines[-1]["cum_bits_per_param"] == pytest.approx(summary["steps"] * summary["bits_per_param_per_iter"])
    assert (tmp_path / "config.yaml").exists()


def test_sampler_shards_are_disjoint_and_cover_each_epoch():
    sampler = ShardedSampler(num_examples=100, num_workers=3, per_worker_batch=5, seed=0)
    assert sampler.steps_per_epoch == 6  # 33 examples per shard, 6 full batches
    epoch = [sampler.indices(step) for step in range(sampler.steps_per_epoch)]
    for worker in range(3):
        seen = set(torch.cat([batch[worker] for batch in epoch]).tolist())
        assert len(seen) == 30 and seen <= set(sampler.shards[worker].tolist())
    assert not set(sampler.shards[0].tolist()) & set(sampler.shards[1].tolist())
    again = ShardedSampler(num_examples=100, num_workers=3, per_worker_batch=5, seed=0)
    assert all((again.indices(s) == sampler.indices(s)).all() for s in (0, 7, 13))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method.name=sgd"], "method='sgd' is unknown"),
        (["method.aggregation=median"], "method.aggregation='median' is unknown"),
        (["cluster.workers=0"], "cluster.workers=0 must be >= 1"),
        (
            ["cluster.workers=64", "cluster.per_worker_batch=32"],
            "cluster.per_worker_batch=32 is larger than a worker's",
        ),
        (["method.lr=0"], "method.lr=0 must be > 0"),
        (["method.lr=-1"], "method.lr=-1 must be > 0"),
    ],
)
def test_bad_settings_fail_before_training_with_one_clear_line(make_cfg, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        run(make_cfg(*overrides), tmp_path)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_nan_loss_stops_with_a_clear_error(make_cfg, tmp_path):
    cfg = make_cfg("method=adamw", "method.lr=1e30", "train.steps=30", "schedule.name=constant")
    with pytest.raises(FloatingPointError, match="lower method.lr"):
        run(cfg, tmp_path)


def test_finished_run_is_skipped_and_never_overwritten(make_cfg, tmp_path):
    summary = run(make_cfg("train.steps=3"), tmp_path)
    before = (tmp_path / "summary.json").read_text()
    assert run(make_cfg("train.steps=3"), tmp_path) == json.loads(before)
    with pytest.raises(ValueError, match="holds a finished run of another config"):
        run(make_cfg("train.steps=4"), tmp_path)
    assert (tmp_path / "summary.json").read_text() == before
    assert summary["steps"] == 3


def test_cli_prints_one_error_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "distlion.train", "method.lr=-1", "logger=none", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("distlion: error:")]
    assert errors == ["distlion: error: method.lr=-1 must be > 0; set method.lr to a positive learning rate"]


def test_num_evals_sets_how_often_the_validation_split_is_evaluated(make_cfg, tmp_path):
    run(make_cfg("train.steps=20", "train.num_evals=4", "train.log_every=100"), tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "val_accuracy" in m] == [5, 10, 15, 20]
    assert [m["step"] for m in lines if "test_accuracy" in m] == [20]  # the test split once, at the end


def test_a_run_directory_held_by_another_process_is_refused(make_cfg, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / ".lock")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"locked\n"
        with pytest.raises(ValueError, match="being written by another process"):
            run(make_cfg("train.steps=3"), tmp_path)
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert run(make_cfg("train.steps=3"), tmp_path)["steps"] == 3  # the kernel dropped the dead holder's lock


HOLD_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_no_lock_file_is_left_when_a_run_finishes_is_skipped_refused_or_fails(make_cfg, tmp_path):
    run(make_cfg("train.steps=3"), tmp_path / "run")
    assert not list((tmp_path / "run").glob(".lock*"))
    run(make_cfg("train.steps=3"), tmp_path / "run")
    with pytest.raises(ValueError, match="holds a finished run of another config"):
        run(make_cfg("train.steps=4"), tmp_path / "run")
    assert not list((tmp_path / "run").glob(".lock*"))
    with pytest.raises(FloatingPointError):
        run(make_cfg("method=adamw", "method.lr=1e30", "train.steps=30", "schedule.name=constant"), tmp_path / "nan")
    assert not list((tmp_path / "nan").glob(".lock*"))


def snapshot(directory):
    return {path.relative_to(directory): (path.read_bytes(), path.stat().st_mtime_ns)
            for path in directory.rglob("*") if path.is_file()}


def test_cli_refusing_or_skipping_a_finished_run_writes_nothing_in_its_directory(make_cfg, tmp_path):
    run(make_cfg("train.steps=3"), tmp_path)
    before = snapshot(tmp_path)
    assert {str(p) for p in before} == {"config.yaml", "metrics.jsonl", "summary.json"}

    def cli(*overrides):
        return subprocess.run(
            [sys.executable, "-m", "distlion.train", "logger=none", "train.progress=false", *overrides,
             f"hydra.run.dir={tmp_path}"],
            capture_output=True, text=True, timeout=120,
        )

    refused = cli("method=adamw", "train.steps=3")
    assert refused.returncode == 2
    (error,) = [line for line in refused.stderr.splitlines() if line.startswith("distlion:")]
    assert error.startswith(f"distlion: error: {tmp_path} holds a finished run of another config")
    assert snapshot(tmp_path) == before  # no .hydra/, job log, config.yaml or lock written
    skipped = cli("train.steps=3")
    assert skipped.returncode == 0 and "already holds this finished run; skipping it" in skipped.stderr
    assert snapshot(tmp_path) == before


def test_the_console_script_finds_its_configs_from_any_folder(tmp_path):
    """`distlion-train` as installed (pip's console script, not `python -m`), started outside the repository."""
    from pathlib import Path

    script = Path(sys.executable).parent / "distlion-train"
    assert script.exists(), "install the package (make setup) to get the distlion-train console script"
    done = subprocess.run([str(script), "method=adamw", "--cfg", "job"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "name: adamw" in done.stdout and "backend: simulated" in done.stdout
