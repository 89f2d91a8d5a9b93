"""The device setting, mixed precision and compilation (issue 38), as far as a machine without a GPU can check them:
which device and process-group backend a setting resolves to, that new settings at their defaults keep every
committed run's config hash, that no distlion code makes a tensor without saying where (`device_guard`), and that
bf16 / fp16 autocast and `torch.compile` train. `scripts/gpu_check.sh` checks the rest on a GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from device_guard import DeviceExplicit, DeviceForgotten
from omegaconf import OmegaConf
from torch import nn

from distlion.amp import LossScale
from distlion.config import ConfigError
from distlion.device import resolve_device, resolve_dist_backend
from distlion.methods.registry import METHODS, runnable_by
from distlion.runio import config_hash

REPO = Path(__file__).resolve().parent.parent
SHORT = ["task=digits", "train.steps=4", "train.eval_every=2", "cluster.workers=2", "cluster.per_worker_batch=8"]


# --------------------------------------------------------------------------------------------------
# Which device, which process-group backend


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine that reports two CUDA devices (resolution only: nothing is placed on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"train.device=cuda: no CUDA device .*use train.device=cpu or auto"):
        resolve_device("cuda")


def test_a_rank_takes_the_gpu_of_its_local_rank(two_gpus, monkeypatch):
    assert resolve_device("auto") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's second rank on the node
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)  # an explicit index wins
    with pytest.raises(ValueError, match=r"train.device=cuda:2: this process sees 2 CUDA device"):
        resolve_device("cuda:2")
    with pytest.raises(ValueError, match=r"train.device='gpu' is unknown; choose one of auto \| cpu"):
        resolve_device("gpu")


def test_a_submitit_task_with_one_visible_gpu_takes_cuda_0(monkeypatch):
    """The launcher exports CUDA_VISIBLE_DEVICES with the task's one GPU and LOCAL_RANK = its index on the node."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 0)


def test_dist_backend_auto_is_nccl_on_cuda_and_gloo_on_the_cpu():
    assert resolve_dist_backend("auto", torch.device("cuda", 1)) == "nccl"
    assert resolve_dist_backend("auto", torch.device("cpu")) == "gloo"
    assert resolve_dist_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ValueError, match="cluster.dist_backend=nccl needs CUDA tensors"):
        resolve_dist_backend("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="cluster.dist_backend='mpi' is unknown"):
        resolve_dist_backend("mpi", torch.device("cpu"))


def test_a_torchdist_run_on_the_cpu_joins_a_gloo_group(make_cfg, tmp_path):
    """... and DDP's own step runs under bf16 autocast (its forward is the wrapped model's)."""
    import torch.distributed as dist

    from distlion.train import run

    try:
        summary = run(make_cfg("cluster=torchdist", "cluster.workers=1", *SHORT[:3]), tmp_path / "dlion")
        assert dist.get_backend() == "gloo"
        ddp = run(make_cfg("cluster=torchdist", "cluster.workers=1", "method=ddp", "train.amp=bf16", *SHORT[:3]),
                  tmp_path / "ddp")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert summary["device"] == "cpu" and ddp["amp"] == "bf16" and math.isfinite(ddp["val_loss"])
    # Where it ran: the same config gives other float results on another CPU model or torch build.
    import platform

    assert summary["machine"] == {**summary["machine"], "host": platform.node(), "threads": 1,
                                  "torch": torch.__version__, "cuda": None, "gpu": None,
                                  "python": platform.python_version()}
    assert summary["machine"]["cpu"] and summary["machine"]["cores"] >= 1


@pytest.mark.parametrize("setting, message", [
    ("train.device=gpu", r"^train.device='gpu' is unknown"),
    ("train.amp=fp8", r"^train.amp='fp8' is unknown; choose one of \('none', 'bf16', 'fp16'\)"),
    ("train.compile=1", r"^train.compile=1 must be true or false"),
    ("+cluster.dist_backend=mpi", r"^cluster.dist_backend='mpi' is unknown"),
])
def test_a_bad_setting_is_one_line_naming_it(make_cfg, setting, message):
    from distlion.config import validate

    overrides = [setting] if "dist_backend" not in setting else ["cluster=torchdist", "cluster.workers=1",
                                                                  setting.lstrip("+")]
    with pytest.raises(ConfigError, match=message) as err:
        validate(make_cfg(*overrides))
    assert "\n" not in str(err.value)


def test_amp_with_low_precision_parameters_and_compile_with_batched_gradients_are_refused(make_cfg):
    from distlion.config import validate

    with pytest.raises(ConfigError, match=r"train.amp=fp16: method=dlion_ddp exchanges inside backward"):
        validate(make_cfg("train.amp=fp16", "method=dlion_ddp", "cluster=torchdist", "cluster.workers=1"))

    with pytest.raises(ConfigError, match=r"train.amp=bf16 .* train.dtype=bfloat16 .* set one of them"):
        validate(make_cfg("train.amp=bf16", "train.dtype=bfloat16"))
    with pytest.raises(ConfigError, match=r"train.compile=true .* use cluster.grad_strategy=sequential"):
        validate(make_cfg("train.compile=true", "cluster.grad_strategy=batched"))


# --------------------------------------------------------------------------------------------------
# The config hash


def test_new_settings_at_their_defaults_keep_every_committed_runs_hash(monkeypatch):
    """Every committed run record's config, with train.device / amp / compile and cluster.dist_backend at their new
    defaults (torchdist runs were made with dist_backend=gloo), hashes to the config_hash its summary recorded."""
    from distlion.records import read_records

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # auto = the CPU these runs were made on
    records = [r for path in sorted(REPO.glob("results/*/records/*.jsonl.gz")) for r in read_records(path)
               if r["config"] is not None]
    assert len(records) >= 400  # the records of results/ (none missing from the check)
    for record in records:
        config = OmegaConf.create(record["config"])
        config.train.device, config.train.amp, config.train.compile = "auto", "none", False
        if config.cluster.backend == "torchdist":
            config.cluster.dist_backend = "auto"
        assert config_hash(config) == record["summary"]["config_hash"], record["run"]


def test_a_cuda_run_amp_and_compile_are_other_runs(make_cfg, two_gpus):
    base = config_hash(make_cfg("train.device=cpu"))
    assert config_hash(make_cfg("train.device=auto")) != base  # auto on a GPU machine is a CUDA run
    assert config_hash(make_cfg("train.device=cuda:1")) == config_hash(make_cfg("train.device=cuda"))
    assert config_hash(make_cfg("train.device=cpu", "train.amp=bf16")) != base
    assert config_hash(make_cfg("train.device=cpu", "train.compile=true")) != base


# --------------------------------------------------------------------------------------------------
# No tensor without a device


def _grads(params: list[torch.Tensor], workers: int, step: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(workers)]


def test_the_guard_catches_a_planted_factory_call_in_a_method(monkeypatch):
    """A method that makes `torch.zeros(n)` in its worker rule, as a CPU-only habit would, is caught in the step."""
    from distlion import Simulation
    from distlion.methods.dlion import DLion

    # The planted rule is compiled as code of distlion/methods/dlion.py, where such a line would be written.
    source = ("def planted(self, grad, state, ctx):\n"
              "    torch.zeros(grad.numel())  # the forgotten device\n"
              "    return rule(self, grad, state, ctx)\n")
    scope = {"torch": torch, "rule": DLion.worker_rule}
    exec(compile(source, str(REPO / "distlion" / "methods" / "dlion.py"), "exec"), scope)
    params = [torch.zeros(10)]
    sim = Simulation("dlion", params, num_workers=2, lr=0.1)
    monkeypatch.setattr(DLion, "worker_rule", scope["planted"])
    with DeviceExplicit(), pytest.raises(DeviceForgotten, match=r"distlion/methods/dlion.py:2: zeros\(...\) without"):
        sim.step(_grads(params, 2, 0))
    # ... and only distlion's and this file's own calls: outside, torch.zeros(n) is the user's business.
    with DeviceExplicit() as guard:
        torch.zeros(3)
    assert guard.checked == 0


@pytest.mark.parametrize("name", runnable_by("simulated"))
def test_every_methods_step_makes_its_tensors_on_the_parameters_device(name):
    from distlion import Simulation

    params = [torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), torch.zeros(5)]
    hparams = {"sync_every": 2} if "sync_every" in METHODS[name].defaults() else {}
    sim = Simulation(name, params, num_workers=3, **hparams)
    with DeviceExplicit():
        for step in range(4):
            sim.step(_grads(params, 3, step), final_sync=step == 3)


@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
def test_distributed_lion_makes_its_tensors_on_the_parameters_device(aggregation):
    from distlion import DistributedLion

    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = DistributedLion(model.parameters(), lr=1e-3, aggregation=aggregation)
    with DeviceExplicit() as guard:
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step), device="cpu")
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        state = optimizer.state_dict()
        optimizer.load_state_dict(state)
    assert guard.checked > 0


@pytest.mark.parametrize("method, cluster", [("dlion", "simulated"), ("dlion_avg", "simulated"),
                                             ("terngrad", "simulated"), ("diloco", "simulated"),
                                             ("dlion", "torchdist")])
def test_a_run_makes_every_tensor_on_its_device(make_cfg, tmp_path, method, cluster):
    """Data, model, gradients, methods, evaluation and checkpoints: a run end to end, resumed once."""
    import torch.distributed as dist

    from distlion.train import run

    workers = ["cluster.workers=1"] if cluster == "torchdist" else []
    sync = ["method.sync_every=2"] if method == "diloco" else []
    cfg = make_cfg(f"method={method}", f"cluster={cluster}", *SHORT, *workers, *sync, "train.checkpoint_every=2")
    try:
        with DeviceExplicit() as guard:
            run(cfg, tmp_path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert guard.checked > 0


# --------------------------------------------------------------------------------------------------
# Mixed precision


def test_the_loss_scale_moves_as_torchs_grad_scaler_does():
    """Against `torch.amp.GradScaler` on the CPU, driven by the same overflows: the same scale after every step."""
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    ours = LossScale(growth_interval=3)
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    overflows = [False, False, False, False, True, False, True, True, False, False, False, False, False]
    for overflow in overflows:
        optimizer.zero_grad()
        scaler.scale((weight * (float("inf") if overflow else 1.0)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        ours.update(skipped=overflow)
        assert ours.scale == scaler.get_scale()


def test_batched_gradients_under_bf16_autocast_match_the_sequential_ones(make_cfg):
    """The per-worker backward of the batched strategy computes in autocast's dtype, as autograd's own backward does
    for each worker alone: the two agree to bf16's precision (not bitwise: the sums run in another order)."""
    from distlion.amp import autocast_loss
    from distlion.cluster.grads import batched_worker_grads, sequential_worker_grads
    from distlion.flat import FlatParams
    from distlion.tasks import build_task

    cfg = make_cfg("task=digits")
    task = build_task(cfg.task, cfg.model)
    torch.manual_seed(0)
    model = task.build_model()
    flat = FlatParams(model)
    loss = autocast_loss(task.per_example_loss, torch.device("cpu"), torch.bfloat16)
    x, y = task.train_batch(torch.arange(16, device="cpu"), torch.Generator().manual_seed(0))
    g_seq = sequential_worker_grads(model, flat, loss, x, y, 4)[0][torch.float32]
    grads, losses = batched_worker_grads(model, flat, loss, x, y, 4)
    g_bat = grads[torch.float32]
    assert g_bat.dtype == torch.float32 and g_bat.shape == g_seq.shape
    for worker in range(4):
        cosine = torch.nn.functional.cosine_similarity(g_bat[worker], g_seq[worker], dim=0)
        assert cosine > 0.999, (worker, cosine)
    fp32 = batched_worker_grads(model, flat, task.per_example_loss, x, y, 4)[0][torch.float32]
    assert not torch.equal(fp32, g_bat)  # autocast did change the arithmetic
    assert torch.isfinite(losses).all()


@pytest.mark.slow
def test_a_bf16_run_trains_as_the_fp32_run_does(make_cfg, tmp_path):
    from distlion.train import run

    settings = ["task=digits", "train.steps=40", "train.num_evals=2", "cluster.workers=4",
                "cluster.per_worker_batch=16"]
    fp32 = run(make_cfg(*settings), tmp_path / "fp32")
    bf16 = run(make_cfg(*settings, "train.amp=bf16"), tmp_path / "bf16")
    assert bf16["amp"] == "bf16" and "amp" not in fp32
    assert bf16["params_sha256"] != fp32["params_sha256"]
    assert bf16["val_loss"] == pytest.approx(fp32["val_loss"], rel=0.05)
    assert bf16["val_accuracy"] == pytest.approx(fp32["val_accuracy"], abs=0.05)
    assert bf16["bits_per_param_per_iter"] == fp32["bits_per_param_per_iter"]  # the messages are the same size


@pytest.mark.slow
def test_an_fp16_overflow_skips_the_step_and_halves_the_scale(make_cfg, tmp_path, monkeypatch):
    """From a scale of 2^28 the scaled fp16 backward overflows: those steps are skipped on every worker (counted in
    skipped_steps, sending nothing), the scale halves at each, and training goes on at the scale that fits."""
    import distlion.train
    from distlion.amp import LossScale as Scale

    monkeypatch.setattr(distlion.train, "LossScale", lambda: Scale(init_scale=2.0**28))
    summary = distlion.train.run(make_cfg("task=digits", "train.steps=40", "train.num_evals=1", "train.log_every=1",
                                          "cluster.workers=4", "cluster.per_worker_batch=16", "train.amp=fp16"),
                                 tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = summary["skipped_steps"]
    assert 10 < skipped < 30 and summary["amp"] == "fp16"
    previous = 0
    for line in lines:
        assert line["loss_scale"] == 2.0 ** (28 - line["skipped_steps"])  # no growth within 2000 clean steps
        if line["skipped_steps"] > previous:  # this step overflowed: nothing sent
            assert line["bits_up_per_param"] == line["bits_down_per_param"] == 0
        else:
            assert line["bits_up_per_param"] == line["bits_down_per_param"] == pytest.approx(1.0, abs=1e-3)
        previous = line["skipped_steps"]
    assert summary["val_accuracy"] > 0.25  # chance is 0.1


@pytest.mark.slow
def test_a_compiled_model_trains_as_the_eager_one(make_cfg, tmp_path):
    """`train.compile=true` (inductor on the CPU here): the same run to float precision, not bitwise (inductor
    fuses and reorders the forward and backward)."""
    from distlion.train import run

    settings = ["task=digits", "train.steps=4", "train.eval_every=4", "cluster.workers=2", "method=adamw",
                "cluster.grad_strategy=sequential"]
    from torch._dynamo.utils import counters

    eager = run(make_cfg(*settings), tmp_path / "eager")
    counters.clear()
    compiled = run(make_cfg(*settings, "train.compile=true"), tmp_path / "compiled")
    assert counters["stats"]["unique_graphs"] > 0  # dynamo did capture the model
    assert compiled["config_hash"] != eager["config_hash"]
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-4)



def test_a_checkpoint_resumes_on_another_device(make_cfg, tmp_path, crash_after_checkpoint, monkeypatch, capsys):
    """A run checkpointed under train.device=cpu resumes under train.device=cuda (another config hash: the device is
    hashed; the same one without it). Here "cuda" is the CPU in disguise, so the resumed run must end exactly where
    the uninterrupted one does, its summary saying that the resume crossed devices; another setting is refused."""
    import distlion.config
    import distlion.train
    from distlion.runio import RunDirConflict

    settings = ["task=digits", "train.steps=12", "train.eval_every=6", "cluster.workers=2",
                "cluster.per_worker_batch=8", "train.checkpoint_every=4"]
    reference = distlion.train.run(make_cfg(*settings, "train.device=cpu"), tmp_path / "reference")
    crash_after_checkpoint(make_cfg(*settings, "train.device=cpu"), tmp_path / "moved", 8)
    with pytest.raises(RunDirConflict, match="was written by another config"):
        distlion.train.run(make_cfg(*settings, "train.device=cpu", "method.lr=0.01"), tmp_path / "moved")
    disguised = lambda setting="auto", local_rank=None: torch.device("cpu")  # noqa: E731
    monkeypatch.setattr(distlion.config, "resolve_device", disguised)
    monkeypatch.setattr(distlion.train, "resolve_device", disguised)
    capsys.readouterr()
    resumed = distlion.train.run(make_cfg(*settings, "train.device=cuda"), tmp_path / "moved")
    assert f"resuming {tmp_path / 'moved'} from step 8" in capsys.readouterr().err
    assert resumed["config_hash"] != reference["config_hash"]
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert "written on another device" in resumed["resume_inexact"]
