"""Numbers that must not get through: non-finite and mis-shaped gradients, impossible settings, and the
torch optimizer patterns (copies, parameters without gradients, low precision) for DistributedLion."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from timm.optim import Lion
from torch import nn

from distlion import DistributedLion, Simulation
from distlion.methods import build_method, runnable_by
from distlion.methods.step import NonFiniteGradient

NAN, INF = float("nan"), float("inf")


def clone_states(sim: Simulation) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in s.items()} for s in sim.cluster.worker_states[torch.float32]]


def test_the_issue_repro_raises_naming_step_worker_and_parameter():
    sim = Simulation("dlion", [torch.zeros(4), torch.zeros(2)], 3, lr=0.1)
    good = [torch.ones(4), torch.ones(2)]
    sim.step([good] * 3)
    bad = [torch.ones(4), torch.tensor([1.0, NAN])]
    with pytest.raises(NonFiniteGradient, match=r"step 1: worker 2's gradient of 1 is not finite"):
        sim.step([good, good, bad])


@pytest.mark.parametrize("name", runnable_by("simulated"))
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_skip_leaves_every_worker_and_the_parameters_untouched(name, value):
    gen = torch.Generator().manual_seed(0)
    sim = Simulation(name, [torch.randn(6, 5, generator=gen), torch.randn(5, generator=gen)], 3, lr=0.01,
                     nonfinite="skip")
    grads = lambda: [[torch.randn(6, 5, generator=gen), torch.randn(5, generator=gen)] for _ in range(3)]  # noqa: E731
    sim.step(grads())
    params, states = [p.clone() for p in sim.params], clone_states(sim)
    bad = grads()
    bad[1][0][2, 3] = value
    out = sim.step(bad)
    assert out.skipped and out.bits_up == [0, 0, 0] and out.bits_down == 0
    assert all(torch.equal(p, q) for p, q in zip(sim.params, params, strict=True))
    assert all(torch.equal(s[k], t[k]) for s, t in zip(clone_states(sim), states, strict=True) for k in s)
    assert not sim.step(grads()).skipped


def test_a_skipped_step_is_as_if_it_never_happened():
    """Odd N and continuous gradients (no ties, so the step index does not matter): g1, NaN, g2 == g1, g2."""
    gen = torch.Generator().manual_seed(1)
    g1, g2 = ([[torch.randn(50, generator=gen)] for _ in range(3)] for _ in range(2))
    bad = [[torch.full((50,), NAN)]] * 3
    a = Simulation("dlion", [torch.zeros(50)], 3, lr=0.1, nonfinite="skip")
    b = Simulation("dlion", [torch.zeros(50)], 3, lr=0.1)
    for grads in (g1, bad, g2):
        a.step(grads)
    for grads in (g1, g2):
        b.step(grads)
    assert torch.equal(a.params[0], b.params[0])
    assert torch.equal(a.cluster.worker_states[torch.float32][0]["momentum"],
                       b.cluster.worker_states[torch.float32][0]["momentum"])


@pytest.mark.parametrize(
    ("grads", "message"),
    [
        ([torch.ones(1), torch.ones(3)], r"worker 0's gradient 0 is torch.float32 \(1,\), but parameter 0 is "
                                         r"torch.float32 \(4,\)"),
        ([torch.ones(3), torch.ones(4)], r"gradient 0 is torch.float32 \(3,\), but parameter 0"),  # swapped order
        ([torch.ones(4)], "worker 0 gave 1 gradients for 2 parameters"),
        ([torch.ones(4), torch.ones(3), torch.ones(1)], "worker 0 gave 3 gradients for 2 parameters"),
        ([torch.ones(4, dtype=torch.float64), torch.ones(3)], "gradient 0 is torch.float64"),
    ],
)
def test_gradients_must_match_the_parameters_exactly(grads, message):
    sim = Simulation("dlion", [torch.zeros(4), torch.zeros(3)], 2, lr=0.1)
    with pytest.raises(ValueError, match=message):
        sim.step([grads, [torch.ones(4), torch.ones(3)]])


def test_a_transposed_gradient_of_the_same_size_is_refused():
    sim = Simulation("lion", [torch.zeros(2, 3)], 1, lr=0.1)
    with pytest.raises(ValueError, match=r"gradient 0 is torch.float32 \(3, 2\), but parameter 0 is torch.float32"):
        sim.step([[torch.ones(3, 2)]])


@pytest.mark.parametrize("lr", [-5.0, 0.0, NAN, INF])
def test_step_lr_must_be_finite_and_positive(lr):
    sim = Simulation("dlion", [torch.zeros(4)], 2, lr=0.1)
    with pytest.raises(ValueError, match=r"step\(lr=\.\.\.\)="):
        sim.step([[torch.ones(4)]] * 2, lr=lr)


@pytest.mark.parametrize(
    ("name", "hparams", "message"),
    [
        ("dlion", {"betas": (1.5, -1)}, r"method.betas=\[1.5, -1\] must be two coefficients in \[0, 1\)"),
        ("lion", {"betas": (0.9,)}, "method.betas"),
        ("adamw", {"betas": (0.9, 1.0)}, "method.betas"),
        ("terngrad", {"momentum": 1.2}, "method.momentum=1.2 must be in"),
        ("graddrop", {"betas": (-0.1, 0.9)}, "method.betas"),
        ("adamw", {"eps": 0}, "method.eps=0 must be > 0"),
        ("dlion", {"lr": NAN}, "method.lr=nan must be > 0"),
        ("dlion", {"lr": INF}, "method.lr=inf must be finite"),
        ("dlion", {"weight_decay": NAN}, "method.weight_decay=nan must be finite"),
        ("signum", {"momentum": -0.5}, "method.momentum=-0.5"),
    ],
)
def test_impossible_hyperparameters_fail_at_construction(name, hparams, message):
    with pytest.raises(ValueError, match=message):
        build_method(name, **hparams)


# ------------------------------------------------------------------------------------------------
# DistributedLion in one process (a world of one) against timm's Lion


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_distributed_lion_continues_like_the_original(how):
    model = small_model()
    optimizer = DistributedLion(model.parameters(), lr=1e-3, weight_decay=0.1, aggregation="avg", mavo_tie="positive")
    train_steps(model, optimizer, 3)
    both = copy.deepcopy((model, optimizer)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, optimizer)))
    twin, twin_optimizer = both
    assert twin_optimizer.defaults["aggregation"] == "avg" and twin_optimizer.defaults["mavo_tie"] == "positive"
    assert twin_optimizer.process_group is None
    train_steps(model, optimizer, 4, seed=2)
    train_steps(twin, twin_optimizer, 4, seed=2)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_parameters_without_a_gradient_are_left_alone_as_timm_lion_does():
    model, reference = small_model(), small_model()
    extra, extra_ref = (nn.Parameter(torch.ones(5)) for _ in range(2))  # in the optimizer, never in the loss
    ours = DistributedLion([*model.parameters(), extra], lr=1e-3, weight_decay=0.5)
    theirs = Lion([*reference.parameters(), extra_ref], lr=1e-3, weight_decay=0.5)
    model[0].weight.requires_grad_(False)  # frozen after construction: no gradient either
    reference[0].weight.requires_grad_(False)
    train_steps(model, ours, 10)
    train_steps(reference, theirs, 10)
    assert torch.equal(extra, torch.ones(5)) and torch.equal(model[0].weight, small_model()[0].weight)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)
    assert "exp_avg" not in ours.state[extra]


def test_non_contiguous_parameters_and_param_groups():
    base = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    p, q = nn.Parameter(base.clone().t()), nn.Parameter(base.clone().t())  # transposed: not contiguous
    assert not p.is_contiguous()
    b, c = nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(5))
    ours = DistributedLion([{"params": [p]}, {"params": [b], "lr": 1e-2, "weight_decay": 0.0}], lr=1e-3,
                           weight_decay=0.1)
    theirs = Lion([{"params": [q]}, {"params": [c], "lr": 1e-2, "weight_decay": 0.0}], lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        g, h = torch.randn(4, 5, generator=gen), torch.randn(5, generator=gen)
        p.grad, q.grad, b.grad, c.grad = g.clone(), g.clone(), h.clone(), h.clone()
        ours.step()
        theirs.step()
    assert torch.allclose(p, q, atol=1e-6, rtol=0) and torch.allclose(b, c, atol=1e-6, rtol=0)


def test_rosenbrock_is_minimised():
    xy = nn.Parameter(torch.tensor([-1.5, 2.0]))
    optimizer = DistributedLion([xy], lr=1e-2)
    start = None
    for _ in range(600):
        optimizer.zero_grad()
        loss = (1 - xy[0]) ** 2 + 100 * (xy[1] - xy[0] ** 2) ** 2
        start = float(loss.detach()) if start is None else start
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < start / 100


def test_distributed_lion_non_finite_gradient_raises_or_skips():
    model = small_model()
    bad = lambda: [torch.full_like(p, NAN) if i == 1 else torch.ones_like(p)  # noqa: E731
                   for i, p in enumerate(model.parameters())]
    optimizer = DistributedLion(model.parameters(), lr=1e-3)
    for p, g in zip(model.parameters(), bad(), strict=True):
        p.grad = g
    with pytest.raises(NonFiniteGradient, match="parameter 1 of its param group"):
        optimizer.step()
    before = [p.clone() for p in model.parameters()]
    skipping = DistributedLion(model.parameters(), lr=1e-3, nonfinite="skip")
    skipping.step()
    assert skipping.skipped_steps == 1 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_low_precision_parameters_warn_and_master_weights_keep_the_update():
    with pytest.warns(UserWarning, match="master_weights=True"):
        DistributedLion([nn.Parameter(torch.ones(3, dtype=torch.bfloat16))], lr=1e-4)
    lost = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    kept = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    full = nn.Parameter(torch.ones(64))
    with pytest.warns(UserWarning):
        plain = DistributedLion([lost], lr=1e-4)
    optimizers = [plain, DistributedLion([kept], lr=1e-4, master_weights=True), DistributedLion([full], lr=1e-4)]
    for step in range(100):
        grad = torch.randn(64, generator=torch.Generator().manual_seed(step))
        for p, optimizer in zip((lost, kept, full), optimizers, strict=True):
            p.grad = grad.to(p.dtype)
            optimizer.step()
    assert torch.equal(lost, torch.ones(64, dtype=torch.bfloat16))  # every update rounded away
    master = optimizers[1].state[kept]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, full.detach())
    assert torch.equal(kept.detach(), full.detach().to(torch.bfloat16)) and not torch.equal(kept, lost)
    assert math.isclose(float((full.detach() - 1).abs().max()), 100 * 1e-4, rel_tol=0.5)


# ------------------------------------------------------------------------------------------------
# The runner: every bad setting is one line, before anything is built or trained


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method.betas=[1.5,-1]"], r"method.betas=\[1.5, -1\] must be two coefficients in \[0, 1\)"),
        (["train.num_evals=0"], "train.num_evals=0 must be >= 1"),
        (["train.log_every=0"], "train.log_every=0 must be >= 1"),
        (["cluster.workers=abc"], "cluster.workers='abc' must be >= 1, a whole number"),
        (["cluster.workers=2.5"], "cluster.workers=2.5 must be >= 1, a whole number"),
        (["+method.bogus=1"], r"method.bogus is not a setting of method=dlion; valid: \['aggregation'"),
        (["+method.betass=[0.9,0.9]"], "did you mean method.betas"),
        (["train.nonfinite=ignore"], r"train.nonfinite='ignore' is unknown; choose one of \('error', 'skip'\)"),
        (["train.steps=5", "schedule.warmup_steps=6"], r"schedule.warmup_steps=6 is longer than the run \(5 steps\)"),
        (["method.lr=nan"], "method.lr=nan must be > 0"),
    ],
)
def test_bad_settings_are_one_line_before_training(make_cfg, tmp_path, overrides, message):
    from distlion.train import run

    with pytest.raises(ValueError, match=message) as err:
        run(make_cfg(*overrides), tmp_path / "run")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_runner_skips_a_non_finite_step_and_counts_it(make_cfg, tmp_path, monkeypatch):
    """A NaN gradient at step 3 of worker 1: with skip the run finishes and says so; with error it stops."""
    from distlion.cluster.base import Cluster
    from distlion.train import run

    clean_step = Cluster.step

    def poisoned(self, grads, step, lr, **kwargs):
        if step == 3:
            grads[torch.float32][1, 7] = NAN
        return clean_step(self, grads, step, lr, **kwargs)

    monkeypatch.setattr(Cluster, "step", poisoned)
    settings = ["train.steps=6", "train.eval_every=6", "cluster.workers=2"]
    summary = run(make_cfg(*settings, "train.nonfinite=skip"), tmp_path / "skip")
    assert summary["skipped_steps"] == 1
    with pytest.raises(NonFiniteGradient, match="step 3: worker 1's gradient of"):
        run(make_cfg(*settings), tmp_path / "error")


def test_the_simulated_cluster_keeps_fp32_master_weights_for_bf16():
    """The issue's measurement: lr 1e-4 on bf16 weights near 1 is lost every step without a master copy."""
    grads = [[[torch.full((16,), -1.0, dtype=torch.bfloat16)]] for _ in range(100)]
    with pytest.warns(UserWarning, match="master weights"):
        lost = Simulation("dlion", [torch.ones(16, dtype=torch.bfloat16)], 1, lr=1e-4)
    kept = Simulation("dlion", [torch.ones(16, dtype=torch.bfloat16)], 1, lr=1e-4, master_weights=True)
    full = Simulation("dlion", [torch.ones(16)], 1, lr=1e-4)
    for g in grads:
        lost.step(g), kept.step(g), full.step([[g[0][0].float()]])
    assert torch.equal(lost.params[0], torch.ones(16, dtype=torch.bfloat16))
    master = kept.cluster.masters[torch.bfloat16]
    assert torch.equal(master, full.params[0])  # the fp32 run, exactly
    assert torch.equal(kept.params[0], master.to(torch.bfloat16)) and kept.params[0][0] > 1


def test_the_runner_trains_bf16_parameters_on_fp32_masters_and_resumes_them(make_cfg, tmp_path, monkeypatch):
    """Interrupted after its step-2 checkpoint, a bf16 run resumes (masters included) to the same parameters."""
    from distlion.cluster.base import Cluster
    from distlion.train import run

    settings = ["train.steps=5", "train.eval_every=5", "train.dtype=bfloat16", "cluster.workers=2",
                "train.checkpoint_every=2"]
    whole = run(make_cfg(*settings), tmp_path / "whole")
    clean_step = Cluster.step

    def crash_at_step_3(self, grads, step, lr, **kwargs):
        assert self.masters[torch.bfloat16].dtype == torch.float32
        if step == 3:
            raise KeyboardInterrupt
        return clean_step(self, grads, step, lr, **kwargs)

    monkeypatch.setattr(Cluster, "step", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run(make_cfg(*settings), tmp_path / "resumed")
    monkeypatch.setattr(Cluster, "step", clean_step)
    resumed = run(make_cfg(*settings), tmp_path / "resumed")
    assert resumed["params_sha256"] == whole["params_sha256"] and resumed["test_accuracy"] > 0


def test_settings_added_later_keep_the_hash_of_runs_made_before_them(make_cfg):
    """A finished fp32 run, made before train.dtype / master_weights / nonfinite / test_eval / final_sync and
    task.target existed, is still recognised."""
    from omegaconf import OmegaConf, open_dict

    from distlion.runio import config_hash

    cfg = make_cfg("method=dlion_avg")
    older = OmegaConf.create(OmegaConf.to_container(cfg))
    with open_dict(older):
        for key in ("dtype", "master_weights", "nonfinite", "test_eval", "final_sync"):
            del older.train[key]
        del older.task["target"]
    assert config_hash(cfg) == config_hash(older)
    assert config_hash(make_cfg("method=dlion_avg", "train.dtype=bfloat16")) != config_hash(cfg)
    bf16 = [make_cfg("method=dlion_avg", "train.dtype=bfloat16", f"train.master_weights={m}") for m in (True, False)]
    assert config_hash(bf16[0]) != config_hash(bf16[1])


def test_ranks_resume_at_their_earliest_checkpoint(tmp_path):
    """A rank whose latest checkpoint is ahead of another rank's resumes from its previous one."""
    from types import SimpleNamespace

    from distlion.runio import RunDir
    from distlion.train import _agreed_checkpoint

    directory = RunDir(tmp_path, "hash")
    for step in (2, 4):
        directory.save_checkpoint(".rank1", {"step": step})
    ahead_of = lambda earliest: SimpleNamespace(backend=SimpleNamespace(agree_start=lambda step: earliest))  # noqa: E731
    assert _agreed_checkpoint(directory, ".rank1", ahead_of(4))["step"] == 4
    assert _agreed_checkpoint(directory, ".rank1", ahead_of(2))["step"] == 2
    assert _agreed_checkpoint(directory, ".rank1", ahead_of(0)) is None  # another rank has none: start over
    with pytest.raises(ValueError, match="cannot resume at one step: checkpoint.rank1.pt is at step 4"):
        _agreed_checkpoint(directory, ".rank1", ahead_of(3))


@pytest.mark.parametrize("lr", [NAN, -1e-3])
def test_distributed_lion_refuses_a_scheduled_lr_that_is_negative_or_not_finite(lr):
    model = small_model()
    optimizer = DistributedLion(model.parameters(), lr=1e-3)
    optimizer.param_groups[0]["lr"] = lr  # as a broken scheduler would set it
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"DistributedLion: lr=.* must be finite and >= 0"):  # 0 is a warm-up's start
        optimizer.step()
