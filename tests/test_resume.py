"""A run killed with SIGKILL resumes from its checkpoint and ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distlion.train import run

STEPS = ["train.steps=60", "train.checkpoint_every=10", "train.log_every=5", "train.eval_every=30"]


def launch(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "distlion.train", "logger=none", "train.progress=false", *STEPS, *overrides,
         f"hydra.run.dir={run_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line]
    return json.loads(lines[-1])["step"] if lines else 0


@pytest.mark.parametrize("method", ["dlion", "adamw"])
def test_sigkill_then_resume_matches_uninterrupted(make_cfg, tmp_path, method):
    reference = run(make_cfg(f"method={method}", *STEPS), tmp_path / "reference")

    killed = tmp_path / "killed"
    process = launch(killed, f"method={method}")
    deadline = time.time() + 240
    while last_step(killed) < 25 and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, f"run ended before it could be killed: {process.stderr.read()}"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert (killed / "checkpoint.pt").exists() and not (killed / "summary.json").exists()

    resumed = launch(killed, f"method={method}")
    _, stderr = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, stderr
    assert "resuming" in stderr
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["params_sha256"] == reference["params_sha256"]
    assert summary["test_accuracy"] == reference["test_accuracy"]
    assert summary["total_bits"] == reference["total_bits"]
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 60  # no line lost or written twice


def test_checkpoint_from_another_config_is_refused(make_cfg, tmp_path):
    process = launch(tmp_path)
    deadline = time.time() + 240
    while not (tmp_path / "checkpoint.pt").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    with pytest.raises(ValueError, match="was written by another config"):
        run(make_cfg(*STEPS, "method.lr=0.01"), tmp_path)


@pytest.mark.parametrize("method", ["dlion", "adamw"])
def test_an_unreadable_latest_checkpoint_resumes_from_the_previous_one_exactly(make_cfg, tmp_path,
                                                                               crash_after_checkpoint, capsys, method):
    cfg = make_cfg(f"method={method}", *STEPS)
    reference = run(cfg, tmp_path / "reference")

    crashed = tmp_path / "crashed"
    crash_after_checkpoint(cfg, crashed, 30)
    assert last_step(crashed) == 30 and (crashed / "checkpoint.prev.pt").exists()
    latest = crashed / "checkpoint.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # the last write lost half its data

    capsys.readouterr()
    summary = run(cfg, crashed)
    warning, resuming = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"distlion: checkpoint {latest} is unreadable (RuntimeError: PytorchStreamReader")
    assert warning.endswith("resuming from the previous one at step 20")
    assert resuming == f"distlion: resuming {crashed} from step 20 on cpu"
    assert summary["params_sha256"] == reference["params_sha256"]
    assert summary["total_bits"] == reference["total_bits"]
    steps = [json.loads(line)["step"] for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 60  # the lines past step 20 were written once, again
    assert not list(crashed.glob("checkpoint*")) and not list(crashed.glob(".lock*"))


def test_cli_truncated_checkpoint_without_a_previous_one_is_one_error_line(tmp_path):
    buffer = io.BytesIO()
    torch.save({"step": 10, "params": {"x": torch.zeros(1000)}}, buffer)
    (tmp_path / "checkpoint.pt").write_bytes(buffer.getvalue()[:500])
    process = launch(tmp_path)
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 2 and "Traceback" not in stderr, stderr
    (error,) = [line for line in stderr.splitlines() if line.startswith("distlion:")]
    assert error == (f"distlion: error: checkpoint {tmp_path / 'checkpoint.pt'} is unreadable (RuntimeError: "
                     "PytorchStreamReader failed reading zip archive: failed finding central directory) and no "
                     "readable previous one is left; delete it to start the run over")


def test_a_resume_that_cannot_be_exact_says_so_in_its_log_summary_and_report(make_cfg, tmp_path,
                                                                              crash_after_checkpoint, capsys,
                                                                              monkeypatch):
    """PowerSGD's hook state lives in torch, keyed by DDP's buckets, and starts over on a restart: such a run
    finishes, but its log, summary and report say that it is not the uninterrupted run."""
    from distlion.methods.ddp import DDPMethod
    from distlion.methods.dlion import DLion
    from distlion.report import write_report

    gap = DDPMethod(compression="powersgd", start_iter=10).resume_gap()
    assert gap is not None and "10 plain all-reduce steps" in gap
    assert DDPMethod(compression="bf16").resume_gap() is None and DLion(lr=1e-3).resume_gap() is None

    cfg = make_cfg("method=dlion", "train.steps=20", "train.checkpoint_every=10", "train.eval_every=10")
    monkeypatch.setattr(DLion, "resume_gap", lambda self: "its hook state starts over")  # as PowerSGD's
    assert "resume_inexact" not in run(cfg, tmp_path / "fresh")  # not resumed: nothing to say
    crashed = tmp_path / "runs" / "crashed"
    crash_after_checkpoint(cfg, crashed, 10)
    capsys.readouterr()
    summary = run(cfg, crashed)
    assert ("distlion: warning: this resumed run differs from an uninterrupted one: its hook state starts over"
            in capsys.readouterr().err.splitlines())
    assert summary["resume_inexact"] == "its hook state starts over"
    assert json.loads((crashed / "summary.json").read_text())["resume_inexact"] == summary["resume_inexact"]
    write_report(tmp_path / "runs", tmp_path / "report")
    results = (tmp_path / "report" / "results.md").read_text()
    assert "**1 run(s) resumed inexactly**" in results and "`crashed`: its hook state starts over" in results
