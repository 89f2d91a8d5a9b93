"""Local-update methods (LocalSGD, DiLoCo) on per-worker replicas: the limits that reduce them to global SGD,
DiLoCo's outer step by hand, the bits of a sync, and an exact resume with every worker's own parameters."""

from __future__ import annotations

import pytest
import torch

from distlion import Simulation
from distlion.train import run

LAYOUT = [(5, 4), (4,)]


def grads_of(workers: int, steps: int, seed: int = 0) -> list[list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    return [[[torch.randn(s, generator=gen) for s in LAYOUT] for _ in range(workers)] for _ in range(steps)]


def sgd_on_the_mean(params: list[torch.Tensor], steps, lr: float) -> list[torch.Tensor]:
    x = [p.clone() for p in params]
    for grads in steps:
        for i, p in enumerate(x):
            p -= lr * torch.stack([g[i] for g in grads]).mean(0)
    return x


@pytest.mark.parametrize("method, extra", [("localsgd", {}),
                                           ("diloco", {"outer_lr": 1.0, "outer_momentum": 0.0})])
def test_one_local_step_of_sgd_is_global_sgd_on_the_mean_gradient(method, extra):
    params = [torch.randn(s, generator=torch.Generator().manual_seed(9)) for s in LAYOUT]
    steps = grads_of(3, 4)
    sim = Simulation(method, params, 3, lr=0.1, sync_every=1, inner="sgd", **extra)
    for grads in steps:
        sim.step(grads)
    for got, want in zip(sim.params, sgd_on_the_mean(params, steps, 0.1), strict=True):
        assert torch.allclose(got, want, atol=1e-6)


def test_localsgd_workers_drift_between_syncs_and_meet_at_them():
    params = [torch.zeros(s) for s in LAYOUT]
    sim = Simulation("localsgd", params, 2, lr=0.1, sync_every=3, inner="sgd")
    steps = grads_of(2, 3)
    bits = [sim.step(grads) for grads in steps]
    replicas = sim.cluster.replicas[torch.float32]
    assert torch.equal(replicas[0], replicas[1])  # synced at step 3
    assert [b.bits_up for b in bits[:2]] == [[0, 0], [0, 0]] and [b.bits_down for b in bits[:2]] == [0, 0]
    n = sum(torch.zeros(s).numel() for s in LAYOUT)
    assert bits[2].bits_up == [32 * n, 32 * n] and bits[2].bits_down == 32 * n  # fp32 up and down at the sync
    # between syncs each worker took its own steps: x_i = -0.1 (g_i1 + g_i2 + g_i3); the mean is what counts
    mine = [-0.1 * sum(torch.cat([g.reshape(-1) for g in step[w]]) for step in steps) for w in range(2)]
    assert torch.allclose(replicas[0], (mine[0] + mine[1]) / 2, atol=1e-6)


def test_diloco_outer_nesterov_step_by_hand():
    """Two workers, one parameter vector, inner SGD (lr 0.5), H = 2, outer SGD lr 0.7, momentum 0.9, Nesterov."""
    x0 = torch.tensor([1.0, -2.0])
    g = {0: [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])],
         1: [torch.tensor([3.0, 1.0]), torch.tensor([1.0, 1.0])]}
    sim = Simulation("diloco", [x0], 2, lr=0.5, sync_every=2, inner="sgd", outer_lr=0.7, outer_momentum=0.9)
    for step in range(4):
        sim.step([[g[0][step % 2]], [g[1][step % 2]]])
    # sync 1: locals x0 - 0.5 (g_0 + g_1) per worker; outer grad d1 = mean of 0.5 (sum of its grads)
    d1 = 0.5 * ((g[0][0] + g[0][1]) + (g[1][0] + g[1][1])) / 2
    b1 = d1                                  # momentum buffer after the first step: the gradient itself
    x1 = x0 - 0.7 * (d1 + 0.9 * b1)          # Nesterov: step along g + momentum * buffer
    d2 = d1                                  # the same gradients again from x1: the same outer gradient
    b2 = 0.9 * b1 + d2
    x2 = x1 - 0.7 * (d2 + 0.9 * b2)
    assert torch.allclose(sim.params[0], x2, atol=1e-6)


@pytest.mark.parametrize("method, up", [("diloco_bf16", 16), ("diloco_sign", 1)])
def test_compressed_outer_gradients_send_their_bits_at_a_sync(method, up):
    n = 20 + 4
    sim = Simulation(method, [torch.randn(s) for s in LAYOUT], 3, lr=0.1, sync_every=2)
    steps = grads_of(3, 2)
    first, second = (sim.step(grads) for grads in steps)
    assert first.bits_up == [0, 0, 0]
    padding = 8 * (-(-n // 8)) - n if up == 1 else 0
    assert second.bits_up == [up * n + padding] * 3 and second.bits_down == up * n + padding


def test_signed_outer_gradients_keep_their_error_feedback():
    sim = Simulation("diloco_sign", [torch.zeros(6)], 2, lr=0.1, sync_every=1, inner="sgd", outer_lr=0.01)
    g = torch.tensor([3.0, -1.0, 0.5, -0.5, 2.0, 0.1])
    sim.step([[g], [g]])
    delta = 0.1 * g                                  # what each worker's inner step moved
    scale = delta.abs().mean()
    for state in sim.cluster.worker_states[torch.float32]:
        assert torch.allclose(state["residual"], delta - scale * torch.sign(delta), atol=1e-7)
    assert torch.allclose(sim.params[0], -0.01 * torch.sign(delta) * (1 + 0.9), atol=1e-7)  # Nesterov, 1st step


STEPS = ["train.steps=24", "train.eval_every=12", "cluster.workers=3", "train.checkpoint_every=5"]


@pytest.mark.parametrize("method", ["localsgd", "diloco_sign"])
def test_a_run_with_replicas_resumes_exactly(make_cfg, tmp_path, crash_after_checkpoint, method):
    cfg = make_cfg(f"method={method}", "method.sync_every=4", *STEPS)
    reference = run(cfg, tmp_path / "reference")
    crash_after_checkpoint(cfg, tmp_path / "crashed", 10)  # between two syncs: the workers' parameters differ
    resumed = run(cfg, tmp_path / "crashed")
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert resumed["val_accuracy"] == reference["val_accuracy"]
    # 6 syncs in 24 steps: (32 up + 32 down) / 4 per iteration for LocalSGD, (1 + 1) / 4 plus padding for the vote
    per_sync = 64 if method == "localsgd" else 2
    assert resumed["bits_per_param_per_iter"] == pytest.approx(per_sync / 4, rel=1e-3)
    assert resumed["bits_per_param_per_sync"] == pytest.approx(per_sync, rel=1e-3)  # both, as the table shows


def test_a_run_ends_on_a_sync_so_the_model_that_counts_has_seen_every_step(make_cfg, tmp_path):
    """10 steps at H = 4: syncs at steps 4 and 8 and, with train.final_sync (the default), at the last, its bits
    counted. DiLoCo with inner SGD and an outer SGD step of 1 (no momentum) takes the workers' mean at a sync, as
    LocalSGD does: ended on a sync the two agree. Without it DiLoCo's model is the one of step 8: the last 2 steps
    are lost, as in a run of 8 steps."""
    common = ["method.sync_every=4", "method.inner=sgd", "method.lr=0.05", "cluster.workers=3",
              "schedule.name=constant", "train.eval_every=5"]
    diloco = ["method=diloco", "method.outer_lr=1.0", "method.outer_momentum=0.0", *common]
    local = run(make_cfg("method=localsgd", *common, "train.steps=10"), tmp_path / "localsgd")
    ended = run(make_cfg(*diloco, "train.steps=10"), tmp_path / "ended")
    cut = run(make_cfg(*diloco, "train.steps=10", "train.final_sync=false"), tmp_path / "cut")
    eight = run(make_cfg(*diloco, "train.steps=8"), tmp_path / "eight")

    assert ended["val_loss"] == pytest.approx(local["val_loss"], abs=1e-5)
    assert ended["worker_drift"] < 1e-6 < 1e-3 < cut["worker_drift"]
    assert cut["params_sha256"] == eight["params_sha256"] != ended["params_sha256"]
    assert (ended["syncs"], cut["syncs"], eight["syncs"]) == (3, 2, 2)
    for summary in (local, ended, cut):  # 32 bits up and 32 down per parameter at each sync
        assert summary["bits_per_param_per_iter"] == pytest.approx(64 * summary["syncs"] / 10, rel=1e-3)
        assert summary["bits_per_param_per_sync"] == pytest.approx(64, rel=1e-3)


def test_a_simulation_syncs_when_told_it_is_the_last_step():
    """Simulation.step(final_sync=True) between two of LocalSGD's syncs: the workers send their parameters (32 bits
    up per parameter) and hold their mean afterwards; without it the step sends nothing."""
    sim = Simulation("localsgd", [torch.zeros(6)], 3, lr=0.1, sync_every=4, inner="sgd")
    quiet = sim.step([[torch.randn(6)] for _ in range(3)])
    ended = sim.step([[torch.randn(6)] for _ in range(3)], final_sync=True)
    assert quiet.bits_up == [0] * 3 and quiet.bits_down == 0
    assert ended.bits_up == [32 * 6] * 3 and ended.bits_down == 32 * 6
    assert all(torch.equal(replica, sim.params[0]) for replica in sim.cluster.replicas[torch.float32])


def test_the_last_sync_is_hashed_only_where_it_changes_a_run(make_cfg):
    """Runs made before train.final_sync (which did not sync at the end) keep their hash at false; a method that
    exchanges every step is the same run either way."""
    from omegaconf import OmegaConf, open_dict

    from distlion.runio import config_hash

    for method, changes in (("localsgd", True), ("diloco_sign", True), ("dlion", False)):
        ended, cut = (make_cfg(f"method={method}", f"train.final_sync={value}") for value in (True, False))
        older = OmegaConf.create(OmegaConf.to_container(cut))
        with open_dict(older):
            del older.train["final_sync"]
        assert config_hash(cut) == config_hash(older)
        assert (config_hash(ended) != config_hash(cut)) == changes


@pytest.mark.parametrize("method, per_worker", [("dlion", 4), ("localsgd", 4 + 8), ("diloco", 4 + 8 + 4 + 4),
                                                ("diloco_sign", 4 + 8 + 4 + 4 + 4)])
def test_what_each_worker_holds_in_bytes_per_parameter(method, per_worker):
    """D-Lion: its momentum. LocalSGD: its replica and AdamW's two moments. DiLoCo: also the global parameters and
    the outer momentum (each worker holds them), and with signed outer gradients the error feedback."""
    n, workers = 1000, 3
    sim = Simulation(method, [torch.randn(n)], workers, lr=1e-3, **({"sync_every": 2} if method != "dlion" else {}))
    for _ in range(2):
        sim.step([[torch.randn(n)] for _ in range(workers)])
    assert sim.cluster.state_bytes() == pytest.approx(per_worker * n * workers, abs=16 * workers)  # + AdamW's step


def test_replica_runs_log_drift_and_the_workers_own_models(make_cfg, tmp_path):
    """Evaluated at a sync the workers hold one model (drift 0); between syncs they drift apart, and the mean of
    their own models' scores is logged beside the score of the model that counts (their average)."""
    import json

    run(make_cfg("method=localsgd", "method.sync_every=4", "train.steps=12", "train.eval_every=2",
                 "cluster.workers=3", "method.lr=3e-3"), tmp_path)
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "worker_drift" in line]
    assert [e["step"] for e in evals] == [2, 4, 6, 8, 10, 12]
    for e in evals:
        if e["step"] % 4 == 0:
            assert e["worker_drift"] < 1e-5
            assert e["val_accuracy_local_mean"] == pytest.approx(e["val_accuracy"], abs=1e-9)
        else:
            assert e["worker_drift"] > 1e-3
        assert 0 <= e["val_accuracy_local_mean"] <= 1
    from distlion.report import write_report

    write_report(tmp_path, tmp_path / "report")
    assert (tmp_path / "report" / "worker_drift.png").exists()
    # The diagnostics table: the averaging gain and the drift over the evaluations between syncs (steps 2, 6, 10;
    # at 4, 8 and 12 both are 0 by construction), no vote.
    between = [e for e in evals if e["step"] % 4]
    gain = sum(e["val_accuracy"] - e["val_accuracy_local_mean"] for e in between) / 3
    drift = sum(e["worker_drift"] for e in between) / 3
    assert f"| LocalSGD | {100 * gain:.2f} | {drift:.3g} | — | — | 1 |" in (
        tmp_path / "report" / "results.md").read_text().splitlines()


def test_the_workers_own_models_can_be_scored_at_every_kth_evaluation_only(make_cfg, tmp_path,
                                                                           crash_after_checkpoint):
    """Scoring N local models costs N evaluations: `train.local_eval_every=k` scores them at every k-th and the
    last, drift at every one; the training, and so the run's hash, is the same."""
    import json

    from distlion.runio import config_hash

    every = make_cfg("method=localsgd", "method.sync_every=4", "train.steps=12", "train.eval_every=2",
                     "cluster.workers=3", "method.lr=3e-3")
    sparse_overrides = ("method=localsgd", "method.sync_every=4", "train.steps=12", "train.eval_every=2",
                        "cluster.workers=3", "method.lr=3e-3", "train.local_eval_every=4")
    sparse = make_cfg(*sparse_overrides)
    assert config_hash(sparse) == config_hash(every)
    full, fewer = run(every, tmp_path / "every"), run(sparse, tmp_path / "sparse")
    assert fewer["params_sha256"] == full["params_sha256"]
    evals = [json.loads(line) for line in (tmp_path / "sparse" / "metrics.jsonl").read_text().splitlines()
             if "worker_drift" in line]
    assert [e["step"] for e in evals] == [2, 4, 6, 8, 10, 12]
    assert [e["step"] for e in evals if "val_accuracy_local_mean" in e] == [8, 12]  # the 4th and the last
    assert fewer["val_accuracy_local_mean"] == full["val_accuracy_local_mean"]
    # Resumed after the 3rd evaluation, the count goes on: the 4th is still the one that scores them.
    crash_after_checkpoint(make_cfg(*sparse_overrides, "train.checkpoint_every=6"), tmp_path / "resumed", 6)
    run(make_cfg(*sparse_overrides, "train.checkpoint_every=6"), tmp_path / "resumed")
    resumed = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in resumed if "val_accuracy_local_mean" in e] == [8, 12]
