"""Run directories: the lock file, checkpoints kept one back, unreadable or tampered checkpoints refused in one line."""

from __future__ import annotations

import io
import json
import os
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


def test_a_finished_twin_under_the_same_runs_folder_is_copied_not_trained_again(make_cfg, tmp_path, monkeypatch):
    from distlion.train import run

    monkeypatch.delenv("RANK", raising=False)
    cfg = make_cfg("train.steps=3", "cluster.workers=2", "cluster.per_worker_batch=8")
    first = run(cfg, tmp_path / "runs" / "spec_a" / "point")
    trained = []
    monkeypatch.setattr("distlion.train.train", lambda *args: trained.append(args))
    twin = run(cfg, tmp_path / "runs" / "spec_b" / "final" / "other_name")
    assert not trained and twin["copied_from"] == "runs/spec_a/point"
    copy, original = tmp_path / "runs" / "spec_b" / "final" / "other_name", tmp_path / "runs" / "spec_a" / "point"
    assert (copy / "metrics.jsonl").read_text() == (original / "metrics.jsonl").read_text()
    assert {k: v for k, v in twin.items() if k != "copied_from"} == json.loads(json.dumps(first))
    # Another config (here another seed) is trained; outside a runs/ folder nothing is looked up.
    run(make_cfg("train.steps=3", "cluster.workers=2", "cluster.per_worker_batch=8", "seed=1"),
        tmp_path / "runs" / "spec_b" / "seed1")
    run(cfg, tmp_path / "elsewhere")
    assert len(trained) == 2


def test_a_run_directory_name_longer_than_a_file_name_allows_is_shortened_with_a_hash():
    short = "method=dlion,seed=0"
    assert runio.run_dirname(short) == short  # every name Hydra wrote so far stays as it is
    long = ",".join(f"setting{i}=value{i}" for i in range(20))  # 339 characters
    name = runio.run_dirname(long)
    assert len(name) == runio.DIRNAME_LIMIT and name.startswith(long[:100]) and name == runio.run_dirname(long)
    assert runio.run_dirname(long + ",seed=1") != name


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
