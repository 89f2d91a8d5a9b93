"""Runs as submitit jobs (`hydra/launcher=submitit_local`, the local twin of `submitit_slurm`): a 2-rank torchdist job
ends with the parameters of the same run under torchrun, a sweep with those of the joblib launcher, a
resubmitted sweep skips its finished runs, and a preempted job is requeued and resumes to the uninterrupted
parameters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from distlion.cluster.jobs import JobShape

STEPS = ["train.steps=40", "train.eval_every=40", "train.log_every=5", "logger=none", "train.progress=false"]
# The 2-rank run of the job tests (long enough to be preempted in the middle), and its torchrun reference, once.
RANK_RUN = ["train.steps=60", "train.eval_every=60", "train.log_every=5", "logger=none", "train.progress=false",
            "cluster=torchdist", "cluster.grad_strategy=sequential", "method=dlion"]
LIMIT_S = 300


def train(*args: str, cwd: Path, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    command = [*prefix, "-m", "distlion.train", *args] if prefix else [sys.executable, "-m", "distlion.train", *args]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=LIMIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def summaries(root: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in root.glob("*/summary.json")}


def torchrun(ranks: int) -> tuple[str, ...]:
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}")


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("torchrun")
    train(*RANK_RUN, f"hydra.run.dir={out / 'run'}", cwd=out, prefix=torchrun(2))
    return json.loads((out / "run" / "summary.json").read_text())


def test_the_job_shape_comes_from_the_cluster_config():
    config = OmegaConf.create({
        "hydra": {"launcher": {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
                               "nodes": 1, "tasks_per_node": 1, "gpus_per_node": None}},
        "cluster": {"backend": "torchdist", "nodes": 2, "tasks_per_node": 4, "gpus_per_node": 0}})
    JobShape().on_multirun_start(config)
    assert (config.hydra.launcher.nodes, config.hydra.launcher.tasks_per_node) == (2, 4)
    assert config.hydra.launcher.gpus_per_node is None  # 0 GPUs: no --gpus-per-node
    simulated = OmegaConf.create({"hydra": {"launcher": {"_target_": "x.SlurmLauncher", "tasks_per_node": 1}},
                                  "cluster": {"backend": "simulated"}})
    JobShape().on_multirun_start(simulated)
    assert simulated.hydra.launcher.tasks_per_node == 1  # one process runs all simulated workers


def test_a_two_rank_job_ends_with_the_torchrun_parameters(tmp_path, torchrun_reference):
    done = train("-m", "hydra/launcher=submitit_local", *RANK_RUN, "cluster.tasks_per_node=2",
                 f"hydra.sweep.dir={tmp_path / 'jobs'}", cwd=tmp_path)
    (job,) = summaries(tmp_path / "jobs").values()
    reference = torchrun_reference
    assert job["workers"] == 2 and job["wire_bytes_per_step"] > 0  # two ranks over gloo, not one process
    assert job["params_sha256"] == reference["params_sha256"]
    assert job["total_bits"] == reference["total_bits"]

    # Submitted again: both ranks skip the finished run, which stays as it was.
    train("-m", "hydra/launcher=submitit_local", *RANK_RUN, "cluster.tasks_per_node=2",
          f"hydra.sweep.dir={tmp_path / 'jobs'}", cwd=tmp_path)
    logs = "".join(p.read_text() for p in (tmp_path / "jobs" / ".submitit").glob("*/*_log.err"))
    assert logs.count("already holds this finished run; skipping it") == 2, done.stderr
    assert list(summaries(tmp_path / "jobs").values()) == [job]


def test_a_sweep_through_submitit_equals_the_joblib_sweep(tmp_path):
    sweep = [*STEPS, "method=dlion,adamw", "seed=0,1", "cluster.workers=2"]
    train("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *sweep, f"hydra.sweep.dir={tmp_path / 'joblib'}",
          cwd=tmp_path)
    train("-m", "hydra/launcher=submitit_local", *sweep, f"hydra.sweep.dir={tmp_path / 'jobs'}", cwd=tmp_path)
    jobs, joblib = summaries(tmp_path / "jobs"), summaries(tmp_path / "joblib")
    assert len(jobs) == 4 and jobs.keys() == joblib.keys()
    for name, summary in jobs.items():
        assert summary["params_sha256"] == joblib[name]["params_sha256"], name
        assert summary["val_accuracy"] == joblib[name]["val_accuracy"], name


def test_a_preempted_job_is_requeued_and_resumes_to_the_same_parameters(tmp_path, torchrun_reference):
    run = [*RANK_RUN, "train.checkpoint_every=5"]
    sweep_dir = tmp_path / "jobs"
    driver = subprocess.Popen([sys.executable, "-m", "distlion.train", "-m", "hydra/launcher=submitit_local", *run,
                               "cluster.tasks_per_node=2", f"hydra.sweep.dir={sweep_dir}"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + LIMIT_S

    def metrics_step() -> int:
        lines = [line for p in sweep_dir.glob("*/metrics.jsonl") for line in p.read_text().splitlines() if line]
        return json.loads(lines[-1])["step"] if lines else 0

    while metrics_step() < 20 and driver.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert driver.poll() is None, "the job ended before it could be preempted"
    (controller,) = [p for p in (sweep_dir / ".submitit").iterdir() if p.name.isdigit()]  # named by its pid
    ranks = Path(f"/proc/{controller.name}/task/{controller.name}/children").read_text().split()
    assert len(ranks) == 2
    for pid in ranks:  # SLURM's notice of preemption (--signal=USR2@...) reaches every task
        os.kill(int(pid), signal.SIGUSR2)
    try:
        _, stderr = driver.communicate(timeout=max(1.0, deadline - time.time()))
    finally:
        driver.kill()
    assert driver.returncode == 0, stderr[-3000:]
    (job,) = summaries(sweep_dir).values()
    reference = torchrun_reference
    logs = "".join(p.read_text() for p in controller.glob("*_log.err"))
    assert logs.count("this job is preempted") == 2 and logs.count("resuming") == 2, logs[-3000:]
    assert "CollectiveError" not in logs and not list(sweep_dir.rglob("failed*")), logs[-3000:]
    assert job["params_sha256"] == reference["params_sha256"]
    assert job["total_bits"] == reference["total_bits"]


@pytest.mark.parametrize("shape", [["cluster.tasks_per_node=2", "cluster.nodes=2"]])
def test_a_job_of_another_shape_than_the_config_is_refused(tmp_path, monkeypatch, shape):
    """A sweep over the shape would run every point in the first point's job: the run says so."""
    from distlion.cluster.jobs import export_rank_environment

    for key, value in {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
                       "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_LOCALID": "0",
                       "SUBMITIT_LOCAL_JOB_ID": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RANK", raising=False)
    cluster = OmegaConf.create({k.split(".")[1].split("=")[0]: int(k.split("=")[1]) for k in shape})
    with pytest.raises(ValueError, match=r"job has 2 tasks but cluster.nodes x cluster.tasks_per_node = 4"):
        export_rank_environment(cluster)
