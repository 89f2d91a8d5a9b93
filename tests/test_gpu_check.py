"""scripts/gpu_check.py's own logic, on the CPU: the plan of runs, and the checks it draws from them. (The script
itself runs here as a dry run: `scripts/gpu_check.sh --device cpu`.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from distlion.methods import METHODS

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["gpu_check"]


def test_the_data_dependent_methods_are_those_whose_formula_reads_k_or_u(gpu_check):
    assert {name for name in METHODS if gpu_check.data_dependent(name)} == {"graddrop", "dgc", "demo"}


@pytest.mark.parametrize("name", ["dgc", "graddrop", "demo", "dlion_avg", "terngrad"])
def test_the_formula_probe_holds_on_the_cpu(gpu_check, name):
    shapes = [(12, 7), (12,), (5, 3, 2), (9,)]
    assert gpu_check.formula_problem(name, shapes, torch.device("cpu")) == ""


def test_the_formula_probe_catches_a_count_its_formula_does_not_give(gpu_check, monkeypatch):
    monkeypatch.setitem(METHODS, "dgc", dataclasses.replace(METHODS["dgc"], bits_up="64*k/n"))  # n_dense left out
    problem = gpu_check.formula_problem("dgc", [(12, 7), (12,)], torch.device("cpu"))
    assert problem.startswith("step 0, worker 0:") and "bits up, the formula says" in problem


def test_the_plan_runs_every_method_on_the_device_and_three_cpu_seeds(gpu_check, tmp_path):
    plan = gpu_check.plan("python3", "cuda", tmp_path, sorted(METHODS), ranks=1)
    jobs = {job.name: job for job in plan.jobs}
    for name, info in METHODS.items():
        (device,), (cpu,) = jobs[f"device_{name}"].argvs, jobs[f"cpu_{name}"].argvs
        assert jobs[f"device_{name}"].gpu and not jobs[f"cpu_{name}"].gpu
        assert "train.device=cuda" in device and "train.device=cpu" in cpu and "seed=0,1,2" in cpu
        if "simulated" in info.cls.backends:
            assert "cluster.workers=4" in device and "torch.distributed.run" not in device
        else:  # DDP: a 1-rank torchrun over NCCL on the GPU
            assert device[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
            assert "cluster.dist_backend=nccl" in device
    for name in ("dlion", "dlion_avg"):
        torchrun, simulated = jobs[f"torchrun_{name}"].argvs[0], jobs[f"simulated_{name}"].argvs[0]
        assert "--deterministic" in torchrun and "--deterministic" in simulated
        assert "cluster.grad_strategy=sequential" in torchrun and "cluster.grad_strategy=sequential" in simulated
    killed, resumed = jobs["resume_killed"].argvs
    assert killed[killed.index("--kill-after-checkpoint") + 1] == "10" and "--kill-after-checkpoint" not in resumed
    every_dir = [arg for job in plan.jobs for argv in job.argvs for arg in argv if arg.startswith("hydra.")]
    assert every_dir and all("/runs/" not in arg for arg in every_dir)  # no run is copied from a finished twin


def test_a_bench_row_says_whether_it_met_its_target(gpu_check):
    assert gpu_check.target_mark({"target": "<= 0.7", "value": 0.5}) == " (met)"
    assert gpu_check.target_mark({"target": "<= 1.1", "value": 1.3}) == " (**missed**)"
    assert gpu_check.target_mark({"target": "", "value": 900.0}) == ""
    assert gpu_check.target_mark({"target": "<= 1.1", "value": float("nan")}) == ""
