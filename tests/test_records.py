"""Run identity and records that travel (issue 39): a run's folder is its config hash, a spec's index says which
runs its tables read, the migration from folders named by overrides keeps every number, and the committed records
alone rebuild the committed tables."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from distlion.records import migrate_stage, pack, read_records, unpack
from distlion.report import load_runs
from distlion.train import run

REPO = Path(__file__).resolve().parent.parent


def files_of(run_dir: Path) -> dict:
    """What a run holds, parsed: its config, summary and metrics lines."""
    return {"config": OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")),
            "summary": json.loads((run_dir / "summary.json").read_text()),
            "metrics": [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]}


def test_the_migration_keeps_every_number_and_the_records_restore_them(make_cfg, tmp_path):
    stage = tmp_path / "runs" / "spec" / "final"
    old_names = ["cluster.workers=2,method=adamw,seed=0", "cluster.workers=2,method=dlion,seed=0"]
    for name in old_names:  # the old layout: folders named by their overrides
        run(make_cfg("train.steps=3", "cluster.workers=2", "cluster.per_worker_batch=8", name.split(",")[1]),
            stage / name)
    twin = stage / "a-copy-of-the-same-run"  # the old layout's copied twin: same config hash, same numbers
    shutil.copytree(stage / old_names[0], twin)
    stopped = stage / "cluster.workers=2,method=lion,seed=0"  # stopped part-way: a checkpoint, no summary
    cfg = make_cfg("train.steps=3", "cluster.workers=2", "cluster.per_worker_batch=8", "method=lion")
    stopped.mkdir()
    (stopped / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (stopped / "checkpoint.pt").write_bytes(b"")
    before = {json.loads((stage / n / "summary.json").read_text())["config_hash"]: files_of(stage / n)
              for n in old_names}

    moved = migrate_stage(stage)
    assert sorted(moved) == sorted([*old_names, twin.name]) and set(moved.values()) == set(before)
    from distlion.runio import config_hash as hash_of

    resumed = stage / hash_of(cfg)  # the stopped run moved to where the runner will look for its checkpoint
    assert (resumed / "checkpoint.pt").exists() and not stopped.exists()
    assert sorted(p.name for p in stage.iterdir() if p.is_dir()) == sorted([*before, resumed.name])  # twin folded
    index = json.loads((stage / "index.json").read_text())["points"]
    assert set(index.values()) == set(before) and len(index) == 3  # each old name -> its hash
    for config_hash, files in before.items():
        assert files_of(stage / config_hash) == files

    records = tmp_path / "results" / "spec" / "records"
    assert pack(stage, records, "final") == 2  # the finished runs
    shutil.rmtree(tmp_path / "runs")
    assert unpack(records, tmp_path / "runs" / "spec") == 2
    for config_hash, files in before.items():
        assert files_of(stage / config_hash) == files  # restored exactly, every number
    assert json.loads((stage / "index.json").read_text())["points"] == index

    # A run recorded once keeps its record: the same config retrained elsewhere never replaces it.
    summary = json.loads((stage / config_hash / "summary.json").read_text())
    (stage / config_hash / "summary.json").write_text(json.dumps({**summary, "wall_time": -1.0}))
    pack(stage, records, "final")
    kept = {r["run"]: r for r in read_records(records / "final.jsonl.gz")}
    assert kept[config_hash]["summary"]["wall_time"] == summary["wall_time"]
    first = (records / "final.jsonl.gz").read_bytes()
    pack(stage, records, "final")
    assert (records / "final.jsonl.gz").read_bytes() == first  # the same runs give the same bytes (no time stamp)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


@pytest.mark.parametrize("spec", sorted(p.parent.name for p in REPO.glob("results/*/records")))
def test_the_committed_records_alone_rebuild_their_table(spec, tmp_path):
    """Every row of results/<spec>/runs.csv from the runs its records restore: the same metrics, bits and steps."""
    unpack(REPO / "results" / spec / "records", tmp_path / spec)
    stage = tmp_path / spec / "final" if (tmp_path / spec / "final").is_dir() else tmp_path / spec
    runs = {r["config_hash"]: r for r in load_runs(stage)}
    rows = list(csv.DictReader((REPO / "results" / spec / "runs.csv").open()))
    assert rows and {row["config_hash"] for row in rows} == set(runs)
    compared = 0
    for row in rows:
        summary = runs[row["config_hash"]]
        for column, text in row.items():
            if column in summary and _number(text) is not None and isinstance(summary[column], (int, float)):
                assert math.isclose(_number(text), summary[column], rel_tol=1e-12), (column, row["run_dir"])
                compared += 1
    assert compared >= 10 * len(rows)  # metrics, bits, steps, seed, lr... of every row


SPEC = """
name: ident
base: [task=digits, train.steps=2, cluster.workers=2, cluster.per_worker_batch=8, logger=none, train.progress=false]
sweeps:
  - method=adamw,dlion
seeds: {seeds}
"""


@pytest.mark.slow
def test_a_spec_reports_the_runs_its_index_lists_and_a_fresh_clone_rebuilds_it(tmp_path):
    spec = tmp_path / "ident.yaml"

    def experiment(out: Path, *args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "distlion.experiment", str(spec), "--out", str(out), *args],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    spec.write_text(SPEC.format(seeds="[0]"))
    experiment(tmp_path)
    spec.write_text(SPEC.format(seeds="[1]"))  # the spec moves on: the seed-0 runs stay but leave its table
    experiment(tmp_path)
    folders = [p for p in (tmp_path / "runs" / "ident").iterdir() if (p / "summary.json").exists()]
    assert len(folders) == 4
    for folder in folders:  # one identity: the folder is the config hash
        assert folder.name == json.loads((folder / "summary.json").read_text())["config_hash"]
    table = list(csv.DictReader((tmp_path / "results" / "ident" / "runs.csv").open()))
    assert sorted((row["method"], row["seed"]) for row in table) == [("adamw", "1"), ("dlion", "1")]
    assert len(read_records(tmp_path / "results" / "ident" / "records" / "runs.jsonl.gz")) == 4  # none lost

    fresh = tmp_path / "fresh"  # a clone holding results/ alone
    shutil.copytree(tmp_path / "results", fresh / "results")
    rebuilt = experiment(fresh, "--report-only")
    assert "4 finished runs restored" in rebuilt.stderr
    again = list(csv.DictReader((fresh / "results" / "ident" / "runs.csv").open()))
    strip = [{k: v for k, v in row.items() if k not in ("run_dir", "wall_time", "wall_time_to_target")}
             for row in table]
    assert [{k: v for k, v in row.items() if k not in ("run_dir", "wall_time", "wall_time_to_target")}
            for row in again] == strip
    resumed = experiment(fresh)  # and a resumed spec trains nothing the records hold
    assert "not launched" in resumed.stderr and "training on" not in resumed.stderr

    demo = tmp_path / "demo"  # --no-records (make demo): trains what runs/ lacks; the records keep their first copy
    shutil.copytree(tmp_path / "results", demo / "results")
    records = {r["run"]: r for r in read_records(demo / "results" / "ident" / "records" / "runs.jsonl.gz")}
    trained = experiment(demo, "--no-records")
    assert trained.stderr.count("training on") == 2 and "restored" not in trained.stderr
    assert {r["run"]: r for r in read_records(demo / "results" / "ident" / "records" / "runs.jsonl.gz")} == records


def test_a_run_records_its_config_name_and_the_report_reads_both_names(make_cfg, tmp_path):
    """One name per method: summary.json says dlion_avg (its class, dlion, beside it); summaries that recorded the
    class name with the Avg setting still read as D-Lion (Avg)."""
    from distlion.methods.registry import method_label, variant_of

    summary = run(make_cfg("method=dlion_avg", "train.steps=2", "cluster.workers=2", "cluster.per_worker_batch=8"),
                  tmp_path / "avg")
    assert summary["method"] == "dlion_avg" and summary["method_class"] == "dlion"
    assert load_runs(tmp_path)[0]["label"] == "D-Lion (Avg)"
    assert variant_of("dlion", {"aggregation": "avg"}).name == "dlion_avg"  # an older summary
    assert variant_of("dlion", {"aggregation": "mavo"}).name == "dlion"
    assert method_label("dlion_avg", {"aggregation": "avg"}) == "D-Lion (Avg)"
