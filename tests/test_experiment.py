"""The experiment runner end to end: a spec runs as Hydra multiruns (one grid point at a time or in
parallel through the joblib launcher, with the same results), finished runs are skipped on a rerun,
and the report's tables and CSV carry the runs' own numbers."""

from __future__ import annotations

import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

SPEC = """
name: tiny
description: a 2 x 2 x 2 digits grid
scale: cpu
base: [task=digits, train.steps=8, cluster.per_worker_batch=8, logger=none, train.progress=false]
sweeps:
  - method=dlion,adamw cluster.workers=2,4
seeds: [0, 1]
report:
  columns: workers
"""


def run_experiment(spec: Path, out: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "distlion.experiment", str(spec), "--out", str(out), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def summaries(out: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (out / "runs" / "tiny").glob("*/summary.json")}


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("experiment")
    spec = root / "tiny.yaml"
    spec.write_text(SPEC)
    run_experiment(spec, root / "sequential")
    run_experiment(spec, root / "parallel", "--jobs", "2")
    return spec, root / "sequential", root / "parallel"


def test_parallel_sweep_gives_the_same_runs_as_a_sequential_one(sweeps):
    _, sequential, parallel = sweeps
    seq, par = summaries(sequential), summaries(parallel)
    assert len(seq) == 8 and seq.keys() == par.keys()
    for name in seq:
        assert par[name]["params_sha256"] == seq[name]["params_sha256"], name
        assert par[name]["test_accuracy"] == seq[name]["test_accuracy"]
        assert par[name]["total_bits"] == seq[name]["total_bits"]


def test_rerun_skips_finished_runs_and_keeps_their_files(sweeps):
    spec, sequential, _ = sweeps
    files = {p: p.read_bytes() for p in (sequential / "runs" / "tiny").glob("*/*.json*")}
    stamps = {p: p.stat().st_mtime_ns for p in files}
    run_experiment(spec, sequential)
    assert all(p.read_bytes() == data and p.stat().st_mtime_ns == stamps[p] for p, data in files.items())


def test_a_sweep_whose_runs_are_all_finished_is_not_launched(sweeps, tmp_path):
    """Rerunning a finished spec starts no process; a sweep with one run missing is launched again (its finished
    runs skip themselves there), asking the joblib launcher for one job, not the 4 of --jobs 4, so that the other
    jobs go to the sweeps after it."""
    from distlion.experiment import CONF, sweep_commands, unfinished, with_n_jobs

    spec, sequential, _ = sweeps
    runs = sequential / "runs" / "tiny"
    commands = sweep_commands(yaml.safe_load(spec.read_text()), [], runs)
    parallel = sweep_commands(yaml.safe_load(spec.read_text()), ["hydra/launcher=joblib", "hydra.launcher.n_jobs=4"],
                              runs)
    assert unfinished(commands, CONF) == [] and unfinished(parallel, CONF) == []
    moved = next(runs.glob("*/summary.json"))
    shutil.copytree(moved.parent, tmp_path / "kept")
    moved.unlink()
    try:
        assert unfinished(commands, CONF) == commands
        assert unfinished(parallel, CONF) == [with_n_jobs(parallel[0], 1)] != parallel
    finally:
        shutil.copy2(tmp_path / "kept" / "summary.json", moved)


def test_report_tables_and_csv_carry_the_runs_numbers(sweeps):
    _, _, parallel = sweeps
    runs = summaries(parallel)
    results = parallel / "results" / "tiny"
    rows = list(csv.DictReader((results / "runs.csv").open()))
    assert len(rows) == 8
    for row in rows:
        summary = runs[Path(row["run_dir"]).name]
        assert float(row["test_accuracy"]) == summary["test_accuracy"]
        assert float(row["bits_per_param_per_iter"]) == summary["bits_per_param_per_iter"]

    markdown = (results / "results.md").read_text()
    pivot = next(line for line in markdown.splitlines() if line.startswith("| D-Lion (MaVo) |"))
    for workers in (2, 4):
        accs = [100 * s["test_accuracy"] for s in runs.values() if s["method"] == "dlion" and s["workers"] == workers]
        assert f"{statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f} (n=2)" in pivot
    mavo = next(line for line in markdown.splitlines() if line.startswith("| D-Lion (MaVo) | 4 | 8 |"))
    assert "| 1.000 | 1.000 | 2.000 |" in mavo  # bits per parameter per iteration: 1 up + 1 down
    adamw = next(line for line in markdown.splitlines() if line.startswith("| G-AdamW | 4 | 8 |"))
    assert "| 32.000 | 32.000 | 64.000 |" in adamw

    page = (results / "index.html").read_text()
    plots = ("metric_vs_bits.png", "metric_vs_bits_per_iter.png", "metric_curves.png", "loss_curves.png",
             "metric_vs_workers.png")
    for plot in plots:
        assert (results / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert plot in page


def test_a_sweep_expands_into_its_single_run_points_as_hydra_reads_it():
    from distlion.experiment import sweep_points

    points = sweep_points("method=dlion,ddp cluster.workers=4,8 method.betas=[0.9,0.99]")
    assert points == [["method=dlion", "cluster.workers=4", "method.betas=[0.9,0.99]"],
                      ["method=dlion", "cluster.workers=8", "method.betas=[0.9,0.99]"],
                      ["method=ddp", "cluster.workers=4", "method.betas=[0.9,0.99]"],
                      ["method=ddp", "cluster.workers=8", "method.betas=[0.9,0.99]"]]


def test_sweeps_of_fewer_points_than_jobs_share_them_and_a_sweep_without_joblib_runs_alone(tmp_path):
    """--jobs 2: two one-point sweeps (a D-Lion lr x weight-decay pair each) run side by side, each with n_jobs=1; a
    two-point sweep takes both jobs; a sweep without the joblib launcher waits for the others and runs alone.
    The stand-in sweeps record when they ran and the n_jobs they were given."""
    from distlion.experiment import _run_sweeps

    record = ("import json, sys, time; start = time.time(); time.sleep(1); "
              "open(sys.argv[-1].split('=')[1], 'w').write(json.dumps([start, time.time(), sys.argv[1:-1]]))")

    def sweep(name: str, points: str, n_jobs: int | None) -> list[str]:
        launcher = [f"hydra.launcher.n_jobs={n_jobs}"] if n_jobs else []
        return [sys.executable, "-c", record, "-m", f"seed={points}", *launcher, f"hydra.sweep.dir={tmp_path / name}"]

    assert _run_sweeps([sweep("a", "0", 2), sweep("b", "0", 2), sweep("c", "0,1", 2), sweep("d", "0,1", None),
                        sweep("e", "0", 2)]) == 0
    spans = {name: json.loads((tmp_path / name).read_text()) for name in "abcde"}

    def overlap(x: str, y: str) -> bool:
        return spans[x][0] < spans[y][1] and spans[y][0] < spans[x][1]

    assert overlap("a", "b") and not overlap("a", "c") and not overlap("b", "c")
    assert not any(overlap("d", other) for other in "abce")
    assert [spans[x][2][-1] for x in "abce"] == ["hydra.launcher.n_jobs=1"] * 2 + ["hydra.launcher.n_jobs=2",
                                                                                   "hydra.launcher.n_jobs=1"]
    failing = [sys.executable, "-c", "raise SystemExit(1)", "-m", "seed=0", "hydra.launcher.n_jobs=2"]
    assert _run_sweeps([failing, sweep("f", "0", 2)]) == 1  # counted, and the next sweep still runs
    assert (tmp_path / "f").exists()


NETEM_SPEC = """
name: linked
base: [cluster=torchdist, task=digits, cluster.workers=2, cluster.per_worker_batch=8, train.steps=3,
       train.num_evals=1, train.log_every=1, logger=none, train.progress=false, train.test_eval=false]
sweeps:
  - method=dlion
netem: {ranks: 2, rates: [none]}
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"), reason="needs root and iproute2 (distlion-netem)")
def test_a_spec_with_links_runs_each_point_under_distlion_netem_and_records_the_link(tmp_path):
    spec = tmp_path / "linked.yaml"
    spec.write_text(NETEM_SPEC)
    refused = subprocess.run([sys.executable, "-m", "distlion.experiment", str(spec), "--jobs", "2"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "run it with --jobs 1" in refused.stderr
    done = subprocess.run([sys.executable, "-m", "distlion.experiment", str(spec), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (summary,) = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "linked").glob("*/summary.json")]
    assert summary["link"] == "none" and summary["workers"] == 2 and summary["steps"] == 3
    assert "link check" in done.stdout
    assert "Milliseconds per step, by phase" in (tmp_path / "results" / "linked" / "results.md").read_text()


def test_a_run_asked_for_a_link_refuses_to_run_on_another(make_cfg, monkeypatch):
    from distlion.config import ConfigError, validate

    cfg = make_cfg("cluster=torchdist", "cluster.workers=1", "cluster.link=1gbit")
    monkeypatch.delenv("DISTLION_LINK", raising=False)
    with pytest.raises(ConfigError, match="cluster.link=1gbit but this process runs on no emulated link; launch it "
                                          "with distlion-netem --rate 1gbit"):
        validate(cfg)
    monkeypatch.setenv("DISTLION_LINK", "100mbit")
    with pytest.raises(ConfigError, match="runs on 100mbit"):
        validate(cfg)
    monkeypatch.setenv("DISTLION_LINK", "1gbit")
    validate(cfg)


FINETUNE_SPEC = """
name: finetune
description: pretrain on Gutenberg, finetune on Shakespeare, few-shot scores
pretrain: [task=gutenberg_pretrain, model=llama_cpu, model.hidden_size=32, model.intermediate_size=64,
           model.num_hidden_layers=1, model.num_attention_heads=2, model.num_key_value_heads=2, task.max_chars=30000,
           task.vocab_size=300, task.block_size=64, task.val_examples=8, method=adamw, method.lr=3e-3,
           cluster.workers=2, cluster.per_worker_batch=4, train.steps=10, logger=none, train.progress=false]
base: [task=shakespeare, task.max_chars=20000, task.block_size=64, task.val_examples=8, cluster.workers=2,
       cluster.per_worker_batch=4, train.steps=3, method.lr=1e-3, "eval.tasks=[nextline]", eval.limit=10,
       logger=none, train.progress=false]
sweeps:
  - method=dlion,lion
seeds: [0]
"""


@pytest.mark.skipif(not (REPO.parent / "shared" / "data" / "text").is_dir() and not os.environ.get("DISTLION_DATA")
                    and not os.environ.get("DISTLION_REQUIRE_DATA"), reason="the offline text data is absent")
def test_a_spec_pretrains_once_then_finetunes_every_run_from_the_saved_model(tmp_path):
    spec = tmp_path / "finetune.yaml"
    spec.write_text(FINETUNE_SPEC)
    run_experiment(spec, tmp_path)
    model_dir = tmp_path / "runs" / "finetune" / "pretrain" / "model"
    pretrain = json.loads((model_dir.parent / "summary.json").read_text())
    assert pretrain["task"] == "gutenberg_pretrain" and (model_dir / "tokenizer.json").is_file()
    final = tmp_path / "runs" / "finetune" / "final"
    finals = {p.parent.name: json.loads(p.read_text()) for p in final.glob("*/summary.json")}
    assert sorted(s["method"] for s in finals.values()) == ["dlion", "lion"]
    for name, summary in finals.items():
        config = (final / name / "config.yaml").read_text()
        assert f"pretrained: {model_dir}" in config and summary["num_params"] == pretrain["num_params"]
        assert 0 <= summary["fewshot_acc_nextline"] <= 1 and summary["fewshot_chance_nextline"] == 0.25
        assert "/" not in name  # the model's path is not in the run's folder name
    summaries_now = sorted((tmp_path / "runs" / "finetune").glob("**/summary.json"))
    stamps = [p.stat().st_mtime_ns for p in summaries_now]
    run_experiment(spec, tmp_path)  # everything finished: skipped, the pretraining included
    assert [p.stat().st_mtime_ns for p in summaries_now] == stamps and len(stamps) == 3


def test_a_spec_through_the_submitit_launcher_gives_the_same_runs(sweeps, tmp_path):
    """`distlion-experiment spec hydra/launcher=submitit_local` (SLURM's twin): each point a job, the same runs as the
    sequential sweep's (two of its points)."""
    _, sequential, _ = sweeps
    spec = tmp_path / "tiny.yaml"
    spec.write_text(SPEC.replace("cluster.workers=2,4", "cluster.workers=2").replace("seeds: [0, 1]", "seeds: [0]"))
    run_experiment(spec, tmp_path, "hydra/launcher=submitit_local", "--jobs", "2")  # the launcher's, not joblib
    jobs, seq = summaries(tmp_path), summaries(sequential)
    assert len(jobs) == 2 and jobs.keys() <= seq.keys()
    assert all(jobs[name]["params_sha256"] == seq[name]["params_sha256"] for name in jobs)
    assert (tmp_path / "results" / "tiny" / "results.md").exists()
    assert list((tmp_path / "runs" / "tiny" / ".submitit").iterdir())  # the runs were submitit jobs


@pytest.mark.parametrize("spec_path", sorted((REPO / "experiments").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_spec_composes_and_validates_each_swept_setting(spec_path):
    """A spec that cannot run is caught here, not hours into a sweep: each point of each sweep (and of the tuning)
    composes under Hydra with the spec's base and passes the config checks; no data is read."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from distlion.config import validate
    from distlion.experiment import sweep_points
    from distlion.methods import variant_of
    from distlion.tuning import parse_tuning, trial_sweeps

    spec = OmegaConf.to_container(OmegaConf.load(spec_path), resolve=True)
    # Per sweep, the first point of each method and each value of every other swept setting: every override
    # that can be wrong is composed once (all points would take minutes).
    points = []
    for sweep in spec["sweeps"]:
        seen: set[str] = set()
        for point in sweep_points(sweep):
            if not set(point) <= seen:
                points.append(point)
                seen |= set(point)
    if "tuning" in spec:  # a method's trials differ by lr and weight decay alone: its first one
        tuning = parse_tuning(spec)
        points += [sweep_points(f"{s} {tuning.sweep}")[0] for s in trial_sweeps(tuning)]
    base = [o for o in spec.get("base", []) if not o.startswith(("model.pretrained", "model=llama_pretrained"))]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for point in points:
            overrides = [*base, *point, "seed=0", "logger=none"]
            if any(o.startswith("cluster=torchdist") for o in overrides):
                overrides.append("cluster.workers=2")
            method = validate(compose("config", overrides=overrides))
            # ... and builds the method the point names, with the settings it sets.
            named = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("method=")), None)
            if named is not None:
                assert variant_of(method.name, method.hparams()).name == named, (point, method.name)
            for override in OverridesParser.create().parse_overrides([o for o in point if o.startswith("method.")]):
                got = method.hparams()[override.key_or_group.removeprefix("method.")]
                assert (list(got) if isinstance(got, tuple) else got) == pytest.approx(override.value()), override
    assert points
