"""Run directories: the lock file, checkpoints kept one back, unreadable or tampered checkpoints refused in one line."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distlion import runio
from distlion.cluster.base import BitsTally
from distlion.cluster.grads import worker_grads
from distlion.config import validate
from distlion.runio import CheckpointUnreadable, RunDir, RunDirBusy
from distlion.train import _checkpoint, build_run, worker_batches


def test_the_lock_file_is_removed_when_the_run_ends(tmp_path):
    with RunDir(tmp_path, "h").hold():
        assert (tmp_path / ".lock").exists()
        with pytest.raises(RunDirBusy), RunDir(tmp_path, "h").hold():
            pass
        assert (tmp_path / ".lock").exists()  # a refused process leaves the holder's lock alone
    assert not list(tmp_path.glob(".lock*"))
    with pytest.raises(RuntimeError), RunDir(tmp_path, "h").hold():
        raise RuntimeError("the run failed")
    assert not list(tmp_path.glob(".lock*"))


def test_a_lock_file_removed_by_its_finishing_holder_is_not_held(tmp_path, monkeypatch):
    """The holder finishes (and removes the lock file) between our open and our flock: the flock we then
    get is on a file no other process can see, so we must lock the file now at the path instead."""
    flock, path, calls = runio.fcntl.flock, tmp_path / ".lock", []

    def holder_finishes_first(file, operation):
        calls.append(file)
        if len(calls) == 1:
            path.unlink()
        flock(file, operation)

    monkeypatch.setattr(runio.fcntl, "flock", holder_finishes_first)
    with RunDir(tmp_path, "h").hold():
        monkeypatch.setattr(runio.fcntl, "flock", flock)
        with pytest.raises(RunDirBusy), RunDir(tmp_path, "h").hold():
            pass  # without the retry, this second process would hold the run too
    assert len(calls) == 2


def test_the_previous_checkpoint_is_kept_and_used_when_the_latest_is_unreadable(tmp_path, capsys):
    directory = RunDir(tmp_path, "h")
    for step in (10, 20):
        directory.save_checkpoint("", {"step": step, "params": {"x": torch.full((3,), float(step))}})
    assert directory.load_checkpoint("")["step"] == 20
    assert directory.previous_checkpoint_path("").exists()

    latest = directory.checkpoint_path("")
    latest.write_bytes(latest.read_bytes()[:100])  # a write the disk lost
    checkpoint = directory.load_checkpoint("")
    assert checkpoint["step"] == 10 and checkpoint["params"]["x"].tolist() == [10.0] * 3
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"distlion: checkpoint {latest} is unreadable (RuntimeError: PytorchStreamReader failed")
    assert line.endswith("; removed it, resuming from the previous one at step 10")

    directory.save_checkpoint("", {"step": 20})  # the good step-10 checkpoint stays the previous one
    assert torch.load(directory.previous_checkpoint_path(""), weights_only=True)["step"] == 10
    directory.remove_checkpoint("")
    assert not list(tmp_path.glob("checkpoint*"))


def _truncated_checkpoint() -> bytes:
    buffer = io.BytesIO()
    torch.save({"config_hash": "h", "step": 10, "params": {"x": torch.zeros(1000)}}, buffer)
    return buffer.getvalue()[:500]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "(EOFError)"),
        (_truncated_checkpoint(), "(RuntimeError: PytorchStreamReader failed reading zip archive"),
        (b"not a checkpoint" * 10, "(UnpicklingError: Unsupported operand"),
    ],
)
def test_an_unreadable_checkpoint_without_a_previous_one_says_to_delete_it(tmp_path, content, reason):
    directory = RunDir(tmp_path, "h")
    directory.checkpoint_path("").write_bytes(content)
    with pytest.raises(ValueError, match="delete it to start the run over") as err:
        directory.load_checkpoint("")
    assert str(err.value).startswith(f"checkpoint {directory.checkpoint_path('')} is unreadable {reason}")
    assert "\n" not in str(err.value)
    assert directory.checkpoint_path("").read_bytes() == content  # the user decides what to delete


class RunsCode:
    """What a tampered checkpoint could hold: unpickling it calls os.mkdir(marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path):
    directory, marker = RunDir(tmp_path, "h"), tmp_path / "code_ran"
    torch.save({"config_hash": "h", "step": 10, "torch_rng": RunsCode(marker)}, directory.checkpoint_path(""))
    with pytest.raises(CheckpointUnreadable, match="unsupported GLOBAL posix.mkdir") as err:
        directory.load_checkpoint("")
    assert "\n" not in str(err.value)
    assert not marker.exists()
    torch.load(directory.checkpoint_path(""), weights_only=False)  # the payload is live: unrestricted loading runs it
    assert marker.is_dir()


@pytest.mark.parametrize("method", ["dlion", "dlion_avg", "adamw", "lion", "terngrad", "dgc", "graddrop", "signum"])
def test_every_methods_checkpoint_loads_with_weights_only(make_cfg, tmp_path, method):
    """Checkpoints hold only tensors and plain data (torch optimizer states included), so the restricted
    loader needs no allow-list."""
    cfg = make_cfg(f"method={method}", "cluster.workers=2", "train.steps=100", "method.warmup_epochs=0"
                   if method == "dgc" else "seed=0")
    r = build_run(cfg, validate(cfg))
    bits = BitsTally(r.flat.numel)
    for step in range(2):
        inputs, targets = worker_batches(r.task, r.sampler, r.cluster.local_workers, step, cfg.seed)
        grads, _ = worker_grads(cfg.cluster.grad_strategy)(r.model, r.flat, r.task.per_example_loss, inputs, targets,
                                                            len(r.cluster.local_workers))
        bits.add(r.cluster.step(grads, step=step, lr=1e-3))
    directory = RunDir(tmp_path, "h")
    directory.save_checkpoint("", _checkpoint(2, 1.0, bits, r.flat, r.cluster))
    checkpoint = directory.load_checkpoint("")
    assert checkpoint["step"] == 2
    assert torch.equal(checkpoint["torch_rng"], torch.get_rng_state())
    r.cluster.load_state_dict(checkpoint["cluster"])


def test_outputs_added_later_keep_the_hash_of_runs_made_without_them(make_cfg):
    """A saved model and few-shot scores are outputs: a run without them (every run made before the settings)
    keeps its hash; asking for them makes another run, so a finished run without them is not skipped as its twin."""
    from omegaconf import OmegaConf

    plain = make_cfg()
    before = OmegaConf.create(OmegaConf.to_container(plain))
    del before.train.save_model
    del before["eval"]
    assert runio.config_hash(plain) == runio.config_hash(before)
    assert runio.config_hash(make_cfg("train.save_model=true")) != runio.config_hash(plain)
    assert runio.config_hash(make_cfg("eval.tasks=[nextline]")) != runio.config_hash(plain)
    assert runio.config_hash(make_cfg("eval.num_fewshot=5")) == runio.config_hash(plain)  # no task: no scores


def test_only_a_change_to_code_not_to_what_specs_write_makes_a_result_dirty(tmp_path):
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "distlion").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "distlion" / "method.py").write_text("lr = 1\n")
    (tmp_path / "results" / "tuning.md").write_text("written\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert runio.git_version(tmp_path)["git_dirty"] is False
    (tmp_path / "results" / "tuning.md").write_text("unchanged\n")  # a resumed spec rewrote its tuning table
    assert runio.git_version(tmp_path)["git_dirty"] is False
    (tmp_path / "distlion" / "method.py").write_text("lr = 2\n")
    assert runio.git_version(tmp_path)["git_dirty"] is True


# Issue 39: a full disk, a read-only folder and Ctrl-C each end a run with one line, and lose nothing kept before.
REPO = Path(__file__).resolve().parent.parent

# Run `python -m distlion.train ARGS` with the file named by DISTLION_TEST_FULL (its nth write, n = ..._AT) on a full
# disk (/dev/full: the kernel's real ENOSPC, which torch.save turns into "unexpected pos"), and creating the folder
# DISTLION_TEST_READONLY refused with EACCES (root, as in CI containers, ignores chmod).
FAULTY_TRAIN = """
import errno, os, pathlib, sys
full, at, readonly = os.environ.get("DISTLION_TEST_FULL"), int(os.environ.get("DISTLION_TEST_AT", "1")), \
    os.environ.get("DISTLION_TEST_READONLY")
open_, mkdir, opened = pathlib.Path.open, pathlib.Path.mkdir, []

def faulty_open(self, mode="r", *args, **kwargs):
    if self.name == full and "w" in mode:
        opened.append(self)
        if len(opened) == at:
            open_(self, mode).close()  # the temporary file exists, as on a real disk
            return open_(pathlib.Path("/dev/full"), mode)
    return open_(self, mode, *args, **kwargs)

def faulty_mkdir(self, *args, **kwargs):
    if readonly and str(self).startswith(readonly + "/"):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
    return mkdir(self, *args, **kwargs)

pathlib.Path.open, pathlib.Path.mkdir = faulty_open, faulty_mkdir
from distlion.train import main
main()
"""
CHILD_RUN = ["task=digits", "logger=none", "train.progress=false", "train.log_every=2", "train.eval_every=100"]


def faulty_train(run_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FAULTY_TRAIN, *CHILD_RUN, *args, f"hydra.run.dir={run_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=240, env={**os.environ, **env})


def saved_step(run_dir: Path) -> int:
    return runio._read_checkpoint(run_dir / "checkpoint.pt")["step"]


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("distlion: error:")]
    return line


def test_a_full_disk_at_a_write_removes_its_tmp_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    directory = RunDir(tmp_path, "h")
    directory.save_checkpoint("", {"step": 2, "x": torch.zeros(10)})
    directory.write_summary({"config_hash": "h", "done": 1})
    real_open = Path.open

    def full(self, mode="r", *args, **kwargs):
        if self.name.endswith(".tmp"):
            real_open(self, mode).close()
            return real_open(Path("/dev/full"), mode)
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", full)
    with pytest.raises(runio.WriteFailed, match=f"cannot write {tmp_path / 'checkpoint.pt'}: no space left"):
        directory.save_checkpoint("", {"step": 4, "x": torch.zeros(300_000)})  # past the write buffer
    with pytest.raises(runio.WriteFailed, match=f"cannot write {tmp_path / 'summary.json'}: no space left"):
        directory.write_summary({"config_hash": "h", "done": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "summary.json"]
    assert directory.load_checkpoint("")["step"] == 2 and runio.read_summary(tmp_path)["done"] == 1


@pytest.mark.parametrize(("full", "at"), [("checkpoint.pt.tmp", 2), ("summary.json.tmp", 1)])
def test_cli_a_full_disk_is_one_line_naming_the_file_and_keeps_the_last_checkpoint(tmp_path, full, at):
    done = faulty_train(tmp_path, "train.steps=6", "train.checkpoint_every=2", DISTLION_TEST_FULL=full,
                        DISTLION_TEST_AT=str(at))
    line = one_error_line(done)
    assert f"cannot write {tmp_path / full.removesuffix('.tmp')}: no space left on device" in line, line
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / "summary.json").exists()
    # The checkpoint at step 2 (the one at step 4 failed) or at step 4 (the summary failed) is intact.
    assert saved_step(tmp_path) == (2 if full.startswith("check") else 4)


def test_cli_a_run_directory_in_a_read_only_folder_is_one_line(tmp_path):
    done = faulty_train(tmp_path / "ro" / "run", "train.steps=2", DISTLION_TEST_READONLY=str(tmp_path / "ro"))
    line = one_error_line(done)
    assert "Permission denied" in line and str(tmp_path / "ro" / "run") in line, line


def test_cli_ctrl_c_stops_a_run_in_one_line_saying_where_a_rerun_resumes(tmp_path):
    command = [sys.executable, "-m", "distlion.train", *CHILD_RUN, "train.steps=60", "train.checkpoint_every=4",
               f"hydra.run.dir={tmp_path}"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (tmp_path / "checkpoint.pt").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, f"run ended before it could be interrupted: {process.stderr.read()}"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr
    saved = saved_step(tmp_path)
    (line,) = [line for line in stderr.splitlines() if line.startswith("distlion: interrupted")]
    assert re.fullmatch(rf"distlion: interrupted at step \d+ of 60; rerun the same command to resume from step "
                        rf"{saved}", line), line
    rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0 and f"resuming {tmp_path} from step {saved}" in rerun.stderr, rerun.stderr
