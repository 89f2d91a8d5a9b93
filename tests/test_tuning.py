"""Tuning as part of a spec (issue 13): log grids of one density for every method, lr x wd pairs for the
Lion family, one budget for all, selection by validation and never by test, a loud edge warning, and an
end-to-end tuning on digits whose trials never evaluate the test split (the evaluation is instrumented)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distlion.tuning import (
    Axis,
    Space,
    SpecError,
    log_grid,
    make_point,
    parse_tuning,
    select,
    trial_sweeps,
    write_tuning,
)

REPO = Path(__file__).resolve().parent.parent


def tuning_spec(**section) -> dict:
    base = {"budget": {"train.steps": 60}, "grid_points_per_decade": 2,
            "spaces": {"adamw": {"lr": [1e-4, 1e-2], "weight_decay": [1e-3, 1e-1]},
                       "dlion": {"lr": [1e-5, 1e-3], "lr_x_wd": [1e-5, 1e-4]}}}
    return {"name": "t", "tuning": {**base, **section}}


def test_log_grid_is_log_spaced_with_the_given_density():
    assert log_grid(1e-4, 1e-2, 2) == (1e-4, 3.16e-4, 1e-3, 3.16e-3, 1e-2)
    grid = log_grid(1e-3, 1e-1, 3)
    assert len(grid) == 7
    ratios = [b / a for a, b in zip(grid, grid[1:])]
    assert all(math.isclose(r, 10 ** (1 / 3), rel_tol=5e-3) for r in ratios)
    with pytest.raises(SpecError, match="whole number of grid steps"):
        log_grid(1e-3, 5e-3, 2)


def test_a_grid_moved_off_an_edge_meets_the_old_trials_at_the_same_values():
    # 2.15e-4 * 10^(1/3) rounds to 4.63e-4; the trial run from [1e-4, 1e-3] is at 4.64e-4.
    old, moved = log_grid(1e-4, 1e-3, 3), log_grid(2.15e-4, 2.15e-3, 3)
    assert moved == (2.15e-4, 4.64e-4, 1e-3, 2.15e-3)
    assert set(old) & set(moved) == {2.15e-4, 4.64e-4, 1e-3}
    assert log_grid(3e-4, 3e-3, 3) == (3e-4, 6.46e-4, 1.39e-3, 3e-3)  # off the decade lattice: from lo


def test_every_method_gets_the_same_density_and_lr_x_wd_pairs():
    tuning = parse_tuning(tuning_spec())
    adamw, dlion = tuning.spaces
    assert adamw.lr == log_grid(1e-4, 1e-2, 2) and adamw.axis("weight_decay").values == log_grid(1e-3, 1e-1, 2)
    assert len(adamw.points()) == 5 * 5
    assert dlion.axis("lr_x_wd") is not None and len(dlion.points()) == 5 * 3
    for point in dlion.points():  # weight decay = product / lr, so each product is searched at every lr
        lr, wd = dict(point)["lr"], dict(point)["weight_decay"]
        assert any(math.isclose(lr * wd, p, rel_tol=1e-2) for p in dlion.axis("lr_x_wd").values)
    sweeps = trial_sweeps(tuning)
    assert sweeps[0] == "method=adamw method.lr=0.0001,0.000316,0.001,0.00316,0.01 " \
                        "method.weight_decay=0.001,0.00316,0.01,0.0316,0.1"
    assert sweeps[1] == "method=dlion method.lr=1e-05 method.weight_decay=1.0,3.16,10.0"  # one sweep per lr
    assert len(sweeps) == 1 + 5


@pytest.mark.parametrize("section, message", [
    ({"spaces": {"adamw": {"lr": [1e-4, 1e-2], "budget": {"train.steps": 120}}}}, "same for every method"),
    ({"spaces": {"adamw": {"lr": [1e-4, 1e-2], "train.steps": 120}}}, "same for every method"),
    ({"spaces": {"adamw": {"lr": [1e-4, 1e-2], "grid_points_per_decade": 4}}}, "same for every method"),
    ({"trials": 25}, "same number of trials"),
    ({"objective": "test_accuracy"}, "never by the test split"),
    ({"budget": {"method.lr": 0.1}}, "set by the tuning itself"),
    ({"grid_points_per_decade": None}, "common to every method"),
])
def test_spec_validation_refuses_unequal_or_dishonest_tuning(section, message):
    with pytest.raises(SpecError, match=message):
        parse_tuning(tuning_spec(**section))


def summary(method: str, lr: float, val: float, test: float, seed: int = 0, wd: float = 0.1, **extra) -> dict:
    metrics = [{"key": "test_accuracy", "split": "test", "higher_is_better": True, "scale": 100.0},
               {"key": "val_accuracy", "split": "validation", "higher_is_better": True, "scale": 100.0},
               {"key": "val_loss", "split": "validation", "higher_is_better": False, "scale": 1.0}]
    return {"method": method, "task": "digits", "lr": lr, "method.weight_decay": wd, "seed": seed, "workers": 4,
            "per_worker_batch": 32, "steps": 60, "wall_time": 2.0, "objective": "val_accuracy", "metrics": metrics,
            "val_accuracy": val, "test_accuracy": test, "val_loss": 1 - val, "run_dir": f"{method}-{lr}-{seed}",
            **extra}


def test_selection_picks_by_validation_where_test_disagrees():
    tuning = parse_tuning(tuning_spec(seeds=[0, 1], spaces={"adamw": {"lr": [1e-4, 1e-2]}}))
    runs = [summary("adamw", 1e-4, 0.50, 0.90), summary("adamw", 1e-3, 0.80, 0.60), summary("adamw", 1e-2, 0.70, 0.95),
            # two seeds at 3.16e-3: the mean (0.75) counts, not the best seed (0.85) nor the test (0.99)
            summary("adamw", 3.16e-3, 0.85, 0.99), summary("adamw", 3.16e-3, 0.65, 0.99, seed=1)]
    (choice,) = select(runs, tuning)
    assert dict(choice.best) == {"lr": 1e-3, "weight_decay": 0.1} and choice.objective == "val_accuracy"
    assert choice.edges == [] and len(choice.runs) == 5 and choice.steps == 300

    loss = parse_tuning(tuning_spec(objective="val_loss", seeds=[0, 1], spaces={"adamw": {"lr": [1e-4, 1e-2]}}))
    assert dict(select(runs, loss)[0].best)["lr"] == 1e-3  # lower is better for a loss

    tie = [summary("adamw", 1e-3, 0.8, 0.1), summary("adamw", 3.16e-4, 0.8, 0.9)]
    assert dict(select(tie, tuning)[0].best)["lr"] == 3.16e-4  # a tie: the smaller lr, whatever the order


def test_the_best_point_on_the_edge_of_its_grid_is_warned_and_not_written(tmp_path, capsys):
    tuning = parse_tuning(tuning_spec(spaces={"adamw": {"lr": [1e-4, 1e-2]},
                                              "dlion": {"lr": [1e-4, 1e-2], "lr_x_wd": [1e-5, 1e-3]}}))
    dlion = tuning.space("dlion")
    def at(lr, wd):
        return make_point({"lr": lr, "weight_decay": wd})

    assert dlion.edges(at(1e-3, 0.1)) == []  # lr and lr x wd (1e-4) inside their grids
    assert dlion.edges(at(1e-3, 0.01)) == ["lr_x_wd=1e-05 is the lowest of its grid"]
    assert dlion.edges(at(1e-2, 0.01)) == ["lr=0.01 is the highest of its grid"]
    trials = tmp_path / "tuning"
    for i, (lr, val) in enumerate([(1e-4, 0.5), (1e-3, 0.6), (1e-2, 0.9)]):
        (trials / str(i)).mkdir(parents=True)
        (trials / str(i) / "summary.json").write_text(json.dumps(summary("adamw", lr, val, 0.5)))
    spec = {"name": "t"}
    (choice,) = write_tuning(spec, tuning, trials, tmp_path / "results", "cmd", tmp_path / "tuned")
    assert choice.edges == ["lr=0.01 is the highest of its grid"]
    md = (tmp_path / "results" / "tuning.md").read_text()
    assert "**WARNING: the best point lies on the edge of its grid (lr=0.01 is the highest" in md
    assert "edge of its grid" in capsys.readouterr().out
    assert not (tmp_path / "tuned").exists()
    write_tuning(spec, tuning, trials, tmp_path / "results", "cmd", tmp_path / "tuned", accept_edge=True)
    assert "# WARNING: accepted on the edge" in (tmp_path / "tuned" / "digits_adamw.yaml").read_text()


# Records every split evaluated, in every Python process of the sweeps (Hydra's and joblib's).
HOOK = """
import importlib.abc, importlib.util, json, os, sys

class _Hook(importlib.abc.MetaPathFinder):
    busy = False

    def find_spec(self, name, path, target=None):
        if name != "distlion.tasks.base" or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            evaluate = module.Task.evaluate

            def logged(task, model, split, examples=None):
                with open(os.environ["DISTLION_SPLIT_LOG"], "a") as log:
                    log.write(json.dumps({"split": split, "trial": "train.test_eval=false" in sys.argv}) + "\\n")
                return evaluate(task, model, split, examples)

            module.Task.evaluate = logged

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Hook())
"""

SPEC = """
name: tune
base: [task=digits, train.steps=4, cluster.workers=2, cluster.per_worker_batch=8, logger=none, train.progress=false]
sweeps:
  - method=adamw,dlion
seeds: [0]
tuning:
  objective: validation
  budget: {train.steps: 3}
  seeds: [100]
  grid_points_per_decade: 1
  spaces:
    adamw: {lr: [1e-3, 1e-2]}
    dlion: {lr: [1e-4, 1e-3], lr_x_wd: [1e-5, 1e-5]}
"""


@pytest.mark.slow
def test_tuning_end_to_end_never_touches_the_test_split(tmp_path):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(HOOK)
    spec = tmp_path / "tune.yaml"
    spec.write_text(SPEC)
    committed = {p.name: p.read_bytes() for p in (REPO / "conf" / "tuned").glob("*.yaml")}
    log = tmp_path / "splits.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "hook"), "DISTLION_SPLIT_LOG": str(log)}
    done = subprocess.run([sys.executable, "-m", "distlion.experiment", str(spec), "--out", str(tmp_path), "--tune",
                           "--accept-edge", "--conf-dir", str(tmp_path / "conf")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    trials = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "tune" / "tuning").glob("*/summary.json")]
    assert len(trials) == 4
    for s in trials:
        assert s["val_accuracy"] >= 0 and not any(k.startswith("test_") for k in s)
    for path in (tmp_path / "runs" / "tune" / "tuning").glob("*/metrics.jsonl"):
        assert "test_" not in path.read_text()
    evaluations = [json.loads(line) for line in log.read_text().splitlines()]
    assert {"split": "validation", "trial": True} in evaluations  # the hook sees the trials' evaluations
    assert {"split": "test", "trial": False} in evaluations  # and the final runs' test evaluation
    assert {"split": "test", "trial": True} not in evaluations

    tuned = {p.stem: p.read_text() for p in (tmp_path / "conf" / "tuned").glob("*.yaml")
             if "spec tune," in p.read_text()}
    assert sorted(tuned) == ["digits_adamw", "digits_dlion"]  # the others: copies of conf/tuned
    assert "spec tune" in tuned["digits_dlion"] and "Objective: val_accuracy = " in tuned["digits_dlion"]
    assert "train.steps=3" in tuned["digits_dlion"] and "WARNING: accepted on the edge" in tuned["digits_dlion"]
    finals = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "tune" / "final").glob("*/summary.json")]
    for s in finals:  # the final runs ran with the tuned settings, read from --conf-dir
        text = tuned[f"digits_{s['method']}"]
        assert f"lr: {s['lr']:g}\n" in text and f"weight_decay: {s['method.weight_decay']:g}\n" in text
        assert "test_accuracy" in s
    assert len(finals) == 2

    results = tmp_path / "results" / "tune"
    md = (results / "tuning.md").read_text()
    assert "--tune --accept-edge" in md and "**WARNING: the best point lies on the edge" in md
    assert "| G-AdamW | digits |" in md and "trial-steps" in md
    assert (results / "tuning_val_accuracy_vs_lr.png").read_bytes()[:4] == b"\x89PNG"
    assert (results / "results.md").exists()
    assert {p.name: p.read_bytes() for p in (REPO / "conf" / "tuned").glob("*.yaml")} == committed


def test_a_space_reads_its_point_on_the_lr_x_wd_grid():
    space = Space("lion", (Axis("lr", (1e-4, 1e-3)), Axis("lr_x_wd", (1e-5, 1e-4))))
    assert space.coordinate(make_point({"lr": 1e-3, "weight_decay": 0.1}), "lr_x_wd") == 1e-4
    assert space.coordinate(make_point({"lr": 1e-4, "weight_decay": 0.1}), "lr_x_wd") == 1e-5


def test_trials_of_an_earlier_grid_budget_or_seed_are_not_chosen(tmp_path):
    """A runs folder keeps the trials of earlier specs: only the current grid, budget and seeds count."""
    tuning = parse_tuning(tuning_spec(spaces={"adamw": {"lr": [1e-4, 1e-2]}}))
    stale_dir = tmp_path / "stale-budget"
    stale_dir.mkdir()
    budget_key, _, budget_value = tuning.budget[0].partition("=")
    section, leaf = budget_key.rsplit(".", 1)
    (stale_dir / "config.yaml").write_text(f"{section}:\n  {leaf}: {int(budget_value) + 1}\n")
    runs = [summary("adamw", 1e-3, 0.60, 0.60),
            summary("adamw", 3e-3, 0.99, 0.99),  # off the current grid (an earlier one)
            summary("adamw", 1e-2, 0.99, 0.99, seed=7),  # a seed the spec no longer tunes over
            summary("adamw", 1e-4, 0.99, 0.99, run_dir=str(stale_dir))]  # another budget
    (choice,) = select(runs, tuning)
    assert dict(choice.best) == {"lr": 1e-3, "weight_decay": 0.1} and list(choice.trials) == [choice.best]
    # ... but they were tuning effort, and the report counts them beside the grid's trials
    assert sorted(e["lr"] for e in choice.earlier) == [1e-4, 3e-3, 1e-2]
    trials = tmp_path / "tuning"
    for i, run in enumerate([*runs[:3], summary("adamw", 1e-2, 0.5, 0.5)]):
        (trials / str(i)).mkdir(parents=True)
        (trials / str(i) / "summary.json").write_text(json.dumps({k: v for k, v in run.items() if k != "run_dir"}))
    write_tuning({"name": "t"}, tuning, trials, tmp_path / "results", "cmd", None)
    md = (tmp_path / "results" / "tuning.md").read_text()
    assert "| G-AdamW | digits | per_worker_batch=32, workers=4 | 2 (+2 earlier) |" in md
    assert "Also 2 trials of earlier grids, budgets or seeds (120 trial-steps, 4 s; lr 0.003, 0.01)" in md


def adamw_trials(tmp_path: Path):
    """An AdamW grid of three finished trials under tmp_path/tuning, best at lr 1e-3."""
    tuning = parse_tuning(tuning_spec(spaces={"adamw": {"lr": [1e-4, 1e-2]}}))
    trials = tmp_path / "tuning"
    for i, (lr, val) in enumerate([(1e-4, 0.5), (1e-3, 0.9), (1e-2, 0.6)]):
        (trials / str(i)).mkdir(parents=True)
        (trials / str(i) / "summary.json").write_text(json.dumps(summary("adamw", lr, val, 0.5)))
    return tuning, trials


def test_a_rewritten_tuned_file_keeps_the_settings_the_trials_ran_with(tmp_path):
    tuning, trials = adamw_trials(tmp_path)
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    for kept in ({"betas": [0.95, 0.98]}, {"warmup_epochs": 0, "optimizer": "sgd"}):  # scalars alone once broke it
        (tuned / "digits_adamw.yaml").write_text(yaml.safe_dump({"method": {"lr": 5e-3, "weight_decay": 0.1, **kept}}))
        write_tuning({"name": "t"}, tuning, trials, tmp_path / "results", "cmd", tuned)
        written = yaml.safe_load((tuned / "digits_adamw.yaml").read_text())["method"]
        assert written == {"lr": 1e-3, "weight_decay": 0.1, **kept}


def test_tune_runs_no_final_run_while_a_choice_lies_on_the_edge(tmp_path, monkeypatch, capsys):
    from distlion import experiment

    spec = tmp_path / "edge.yaml"
    spec.write_text("name: edge\nbase: [task=digits]\nsweeps: [method=adamw]\nseeds: [0]\ntuning:\n"
                    "  seeds: [100]\n  grid_points_per_decade: 1\n  spaces:\n    adamw: {lr: [1e-4, 1e-2]}\n")
    trials = tmp_path / "runs" / "edge" / "tuning"
    for i, (lr, val) in enumerate([(1e-4, 0.5), (1e-3, 0.6), (1e-2, 0.9)]):  # best: the top of the grid
        (trials / str(i)).mkdir(parents=True)
        (trials / str(i) / "summary.json").write_text(json.dumps(summary("adamw", lr, val, 0.5, seed=100)))
    sweeps = []
    monkeypatch.setattr(experiment, "_run_sweeps", lambda commands: sweeps.append(commands) or 0)
    monkeypatch.setattr(sys, "argv", ["distlion-experiment", str(spec), "--out", str(tmp_path), "--tune",
                                      "--conf-dir", str(tmp_path / "conf")])
    with pytest.raises(SystemExit) as stop:
        experiment.main()
    assert stop.value.code == 1
    assert "G-AdamW: best point on the edge of the grid" in capsys.readouterr().err
    assert len(sweeps) == 1  # the trials' sweeps only, no final runs
    assert not (tmp_path / "runs" / "edge" / "final").exists()
    assert "spec edge," not in (tmp_path / "conf" / "tuned" / "digits_adamw.yaml").read_text()  # not written


def test_tuned_values_are_written_as_floats_even_when_whole():
    from omegaconf import OmegaConf

    from distlion.tuning import yaml_float

    # A weight decay of 0 written as "0" would load as an int: another config hash than the trials' 0.0.
    for value in (0.0, 1.0, 30.0, 1e-5, 0.00464, 1e6):
        loaded = OmegaConf.create(f"v: {yaml_float(value)}").v
        assert isinstance(loaded, float) and loaded == pytest.approx(value, rel=1e-3)


def test_a_tuned_file_holding_the_chosen_setting_is_left_as_it_is(tmp_path):
    # A resumed spec (or a second spec choosing from the same trials) must not rewrite the file's provenance:
    # the final runs that follow record whether the tree is dirty.
    tuning, trials = adamw_trials(tmp_path)
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    target = tuned / "digits_adamw.yaml"
    same = "# tuned by an earlier spec\nmethod:\n  lr: 0.001\n  weight_decay: 0.1\n"
    target.write_text(same)
    write_tuning({"name": "t"}, tuning, trials, tmp_path / "results", "cmd", tuned)
    assert target.read_text() == same
    assert "`digits_adamw.yaml` (unchanged)" in (tmp_path / "results" / "tuning.md").read_text()
    target.write_text(same.replace("0.001", "0.002"))  # another setting: rewritten with this spec's provenance
    write_tuning({"name": "t"}, tuning, trials, tmp_path / "results", "cmd", tuned)
    assert yaml.safe_load(target.read_text())["method"] == {"lr": 1e-3, "weight_decay": 0.1}
    assert "spec t," in target.read_text()


def test_trial_seeds_that_are_final_seeds_are_refused(tmp_path, capsys):
    from distlion import experiment

    spec = tmp_path / "reuse.yaml"
    spec.write_text("name: reuse\nbase: [task=digits]\nsweeps: [method=adamw]\nseeds: [0, 1, 2]\ntuning:\n"
                    "  seeds: [1, 100]\n  grid_points_per_decade: 1\n  spaces:\n    adamw: {lr: [1e-4, 1e-2]}\n")
    with pytest.raises(SystemExit, match=r"tuning.seeds and the final seeds share \[1\]"):
        sys.argv = ["distlion-experiment", str(spec), "--out", str(tmp_path), "--tune"]
        experiment.main()
    assert not (tmp_path / "runs").exists()  # refused before any trial ran


LM_SPACES = {"lion": {"lr": [2.15e-4, 2.15e-3], "weight_decay": {"values": [0, 0.1, 1.0]},
                      "betas": {"values": [[0.9, 0.99], [0.95, 0.98]]}},
             "adamw": {"lr": [1e-3, 1e-2], "weight_decay": {"values": [0, 0.1, 0.3]},
                       "betas": {"values": [[0.9, 0.95], [0.9, 0.999]]}}}


def test_a_grid_over_lr_weight_decay_and_betas():
    tuning = parse_tuning(tuning_spec(grid_points_per_decade=3, trials=24, seeds=[100, 101], spaces=LM_SPACES))
    lion = tuning.space("lion")
    assert lion.names == ("lr", "weight_decay", "betas") and len(lion.points()) == 4 * 3 * 2
    assert lion.lr == (2.15e-4, 4.64e-4, 1e-3, 2.15e-3)
    assert trial_sweeps(tuning)[0] == ("method=lion method.lr=0.000215,0.000464,0.001,0.00215 "
                                       "method.weight_decay=0.0,0.1,1.0 method.betas=[0.9,0.99],[0.95,0.98]")

    def at(lr, wd, betas):
        return make_point({"lr": lr, "weight_decay": wd, "betas": betas})

    # a weight decay of 0 is no edge (nothing lies below it); betas are values, not a range
    assert lion.edges(at(1e-3, 0.0, [0.9, 0.99])) == []
    assert lion.edges(at(1e-3, 1.0, [0.95, 0.98])) == ["weight_decay=1.0 is the highest of its grid"]
    with pytest.raises(SpecError, match="give a log range"):
        parse_tuning(tuning_spec(spaces={"lion": {"lr": [1e-4, 1e-3], "betas": [0.9, 0.99, 0.5]}}))
    with pytest.raises(SpecError, match="same number of trials"):
        parse_tuning(tuning_spec(grid_points_per_decade=3, trials=24,
                                 spaces={**LM_SPACES, "dlion": {"lr": [2.15e-4, 2.15e-3]}}))


def test_selection_over_betas_writes_them_into_the_tuned_file(tmp_path):
    tuning = parse_tuning(tuning_spec(grid_points_per_decade=3, seeds=[100, 101], spaces=LM_SPACES))
    trials = tmp_path / "tuning"
    scores = {(1e-3, 0.1, (0.95, 0.98)): (0.9, 0.8), (1e-3, 0.1, (0.9, 0.99)): (0.95, 0.6),
              (4.64e-4, 0.0, (0.9, 0.99)): (0.7, 0.7)}
    for i, ((lr, wd, betas), vals) in enumerate(scores.items()):
        for seed, val in zip((100, 101), vals):
            (trials / f"{i}-{seed}").mkdir(parents=True)
            run = summary("lion", lr, val, 0.5, seed=seed, wd=wd, **{"method.betas": list(betas)})
            (trials / f"{i}-{seed}" / "summary.json").write_text(json.dumps(run))
    (choice,) = write_tuning({"name": "t"}, tuning, trials, tmp_path / "results", "cmd", tmp_path / "tuned")
    # the mean over the two trial seeds decides (0.85 against 0.775), not the best single seed (0.95)
    assert dict(choice.best) == {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.95, 0.98)}
    assert len(choice.runs) == 6 and len(choice.trials) == 3
    written = yaml.safe_load((tmp_path / "tuned" / "digits_lion.yaml").read_text())["method"]
    assert written == {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.95, 0.98]}
    md = (tmp_path / "results" / "tuning.md").read_text()
    assert "| **0.001** | **0.1** | **[0.95,0.98]** | **85** | **2** |" in md


def test_final_runs_take_the_choice_of_their_own_workers(tmp_path):
    from distlion.experiment import final_sweeps

    tuning = parse_tuning(tuning_spec(seeds=[100], spaces={"adamw": {"lr": [1e-4, 1e-2]}}))
    runs = [summary("adamw", 1e-3, 0.9, 0.5, seed=100), summary("adamw", 1e-2, 0.5, 0.5, seed=100),
            summary("adamw", 1e-3, 0.5, 0.5, seed=100, workers=8),
            summary("adamw", 1e-2, 0.9, 0.5, seed=100, workers=8)]
    choices = select(runs, tuning)
    assert len(choices) == 2
    spec = {"base": ["task=digits"], "sweeps": ["method=adamw cluster.workers=4,8"]}
    assert final_sweeps(spec, choices) == ["method=adamw cluster.workers=4 method.lr=0.001 method.weight_decay=0.1",
                                           "method=adamw cluster.workers=8 method.lr=0.01 method.weight_decay=0.1"]
    # tuned at 4 workers alone: the 16-worker runs use that choice, as such a spec says
    assert final_sweeps({"sweeps": ["method=adamw cluster.workers=16"]}, choices[:1]) == [
        "method=adamw cluster.workers=16 method.lr=0.001 method.weight_decay=0.1"]
    with pytest.raises(SpecError, match="2 tuned settings of adamw fit"):  # which of the two? say so
        final_sweeps({"sweeps": ["method=adamw cluster.workers=16"]}, choices)
    assert final_sweeps({"sweeps": ["method=dlion"]}, choices) == ["method=dlion"]  # not tuned: its config


def test_optuna_draws_from_the_same_space_as_the_grid():
    import optuna

    from distlion.tuning import suggest

    lion = parse_tuning(tuning_spec(grid_points_per_decade=3, spaces=LM_SPACES)).space("lion")
    drawn = suggest(optuna.trial.FixedTrial({"lr": 0.0012345, "weight_decay": 2, "betas": 1}), lion)
    assert drawn == {"lr": 0.00123, "weight_decay": 1.0, "betas": [0.95, 0.98]}  # 3 digits; listed values by index
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    for _ in range(20):  # every draw inside the grid's ranges and among its listed values
        trial = study.ask()
        drawn = suggest(trial, lion)
        assert 2.15e-4 <= drawn["lr"] <= 2.15e-3 and drawn["weight_decay"] in (0.0, 0.1, 1.0)
        assert drawn["betas"] in ([0.9, 0.99], [0.95, 0.98])
        study.tell(trial, drawn["lr"])
    dlion = parse_tuning(tuning_spec()).space("dlion")  # lr x wd over [1e-5, 1e-4]: weight decay = product / lr
    drawn = suggest(optuna.trial.FixedTrial({"lr": 1e-4, "lr_x_wd": 3e-5}), dlion)
    assert drawn == {"lr": 1e-4, "weight_decay": 0.3}


@pytest.mark.slow
def test_grid_against_optuna_at_the_same_budget(tmp_path):
    spec = tmp_path / "samplers.yaml"
    spec.write_text("name: samplers\nbase: [task=digits, train.steps=2, cluster.workers=2, cluster.per_worker_batch=8,"
                    " logger=none, train.progress=false]\nsweeps: [method=adamw]\nseeds: [0]\ntuning:\n"
                    "  seeds: [100]\n  grid_points_per_decade: 1\n  spaces:\n    adamw: {lr: [1e-3, 1e-2]}\n")
    done = subprocess.run([sys.executable, "-m", "distlion.experiment", str(spec), "--out", str(tmp_path),
                           "--tune-only", "--accept-edge", "--compare-samplers", "--conf-dir", str(tmp_path / "conf")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "results" / "samplers" / "samplers.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| G-AdamW |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2" and cells[-1] in ("grid", "TPE")  # the grid's budget, spent by TPE too
    grid = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "samplers" / "tuning").glob("*/summary.json")]
    tpe = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "samplers" / "tuning_optuna").glob("*/summary.json")]
    assert len(grid) == 2 and 1 <= len(tpe) <= 3 * 2  # 3 sampler seeds x 2 trials, a point drawn twice runs once
    assert float(cells[2]) == pytest.approx(100 * max(s["val_accuracy"] for s in grid), abs=1e-2)
    for s in tpe:
        assert 1e-3 <= s["lr"] <= 1e-2 and s["seed"] == 100 and "test_accuracy" not in s  # trials never test
    records = tmp_path / "results" / "samplers" / "records"
    assert (records / "tuning.jsonl.gz").exists()
