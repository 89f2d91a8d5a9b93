"""Run records that travel with their tables: `results/<spec>/records/<stage>.jsonl.gz`.

A spec's runs live in `runs/<spec>/<stage>/<config hash>/` (config.yaml, metrics.jsonl, summary.json, checkpoints
while running): a working folder, not committed. What a table is built from is packed beside the table, one
compressed JSON line per finished run with its config, summary and metrics, so that `results/` alone rebuilds every
table (`distlion-experiment <spec> --report-only`) and a spec resumed on another machine skips what is done:

    {"record": 1, "run": "<folder name>", "config": {...}, "summary": {...}, "metrics": [{...}, ...]}

plus the stage's index (the spec's points and their hashes, `distlion.experiment.write_index`) as `<stage>.index.json`.
Stages: `tuning`, `final`, `pretrain` (a spec with a tuning or a pretraining), or `runs` (the spec's folder itself).
A run that saved a model (`train.save_model`) is recorded but not restored: its model is not in the record, so a
resumed spec trains it again (deterministically: the same model).

`python -m distlion.records --migrate runs/` moves the run folders of the old layout (named by their overrides)
to their config hash and packs every spec's records; it keeps every number (tests/test_records.py).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from distlion.runio import atomic_write_text, config_hash, read_summary

VERSION = 1
STAGES = ("tuning", "tuning_optuna", "final", "pretrain")
INDEX = "index.json"


def stage_dirs(spec_dir: Path) -> dict[str, Path]:
    """The spec's stage folders that exist: tuning/final/pretrain, or the spec folder itself as `runs`."""
    found = {stage: spec_dir / stage for stage in STAGES if (spec_dir / stage).is_dir()}
    return found or ({"runs": spec_dir} if spec_dir.is_dir() else {})


def finished_runs(stage_dir: Path) -> list[Path]:
    """The finished runs of a stage: its subfolders with a summary, or the stage folder itself (a pretraining)."""
    if (stage_dir / "summary.json").is_file():
        return [stage_dir]
    return sorted(p for p in stage_dir.iterdir() if (p / "summary.json").is_file()) if stage_dir.is_dir() else []


def record_of(run_dir: Path, stage_dir: Path) -> dict[str, Any]:
    metrics = run_dir / "metrics.jsonl"
    shards = run_dir / "shards.json"
    record = {"record": VERSION, "run": "." if run_dir == stage_dir else run_dir.name,
              "config": OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
              if (run_dir / "config.yaml").is_file() else None,
              "summary": json.loads((run_dir / "summary.json").read_text()),
              "metrics": [json.loads(line) for line in metrics.read_text().splitlines() if line]
              if metrics.is_file() else []}
    if shards.is_file():
        record["shards"] = json.loads(shards.read_text())
    return record


def pack(stage_dir: Path, records_dir: Path, stage: str) -> int:
    """Every finished run of `stage_dir` added to `records_dir/<stage>.jsonl.gz` (sorted by run, no time stamp: the
    same runs give the same bytes; a run recorded before keeps its record) and its index beside it; how many runs
    the file holds."""
    runs = finished_runs(stage_dir)
    if not runs:
        return 0
    records_dir.mkdir(parents=True, exist_ok=True)
    target = records_dir / f"{stage}.jsonl.gz"
    # A recorded run is never replaced: the same config rerun elsewhere (a demo retrained) keeps the first record.
    records = {r["run"]: r for r in read_records(target)} if target.is_file() else {}
    for run in runs:
        name = "." if run == stage_dir else run.name
        if name not in records:
            records[name] = record_of(run, stage_dir)
    lines = "".join(json.dumps(records[name], separators=(",", ":")) + "\n" for name in sorted(records))
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as file:
        file.write(lines.encode())
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(target)
    if (stage_dir / INDEX).is_file():
        atomic_write_text(records_dir / f"{stage}.{INDEX}", (stage_dir / INDEX).read_text())
    return len(records)


def read_records(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as file:
        records = [json.loads(line) for line in file if line.strip()]
    newer = {r.get("record") for r in records} - {VERSION}
    if newer:
        raise ValueError(f"{path}: record version {sorted(newer)} is not {VERSION}; update distlion to read it")
    return records


def unpack(records_dir: Path, spec_dir: Path) -> int:
    """Every recorded run missing from `spec_dir` written back into its stage folder (summary last, so a run counts
    as finished only once whole), and each stage's index where the folder has none; how many runs."""
    restored = 0
    for path in sorted(records_dir.glob("*.jsonl.gz")) if records_dir.is_dir() else []:
        stage = path.name.removesuffix(".jsonl.gz")
        stage_dir = spec_dir if stage == "runs" else spec_dir / stage
        for record in read_records(path):
            run_dir = stage_dir if record["run"] == "." else stage_dir / record["run"]
            if read_summary(run_dir) is not None or record["summary"].get("model_dir"):
                continue  # there already, or a saved model the record does not hold
            run_dir.mkdir(parents=True, exist_ok=True)
            if record.get("config") is not None:
                atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(record["config"])))
            atomic_write_text(run_dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in record["metrics"]))
            if "shards" in record:
                atomic_write_text(run_dir / "shards.json", json.dumps(record["shards"]))
            atomic_write_text(run_dir / "summary.json", json.dumps(record["summary"], indent=2))
            restored += 1
        index = records_dir / f"{stage}.{INDEX}"
        if index.is_file() and not (stage_dir / INDEX).is_file():
            stage_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(stage_dir / INDEX, index.read_text())
    return restored


def pack_spec(spec_dir: Path, records_dir: Path) -> dict[str, int]:
    """Every stage of a spec's runs folder packed; runs per stage."""
    return {stage: pack(stage_dir, records_dir, stage) for stage, stage_dir in stage_dirs(spec_dir).items()}


def migrate_stage(stage_dir: Path) -> dict[str, str]:
    """Rename the stage's run folders to their config hash (the old layout named them by their overrides), those
    stopped part-way with checkpoints too (they resume there), and write its index of every finished run; the old
    name -> the hash of the finished ones. A folder whose hash another folder of the
    stage already holds is a copy of the same run (the old layout copied finished twins) and is dropped once its
    summary is found to hold the same numbers."""
    moved: dict[str, str] = {}
    if (stage_dir / "summary.json").is_file():
        return moved  # a pretraining: the stage folder is the run
    for run_dir in finished_runs(stage_dir):
        summary = json.loads((run_dir / "summary.json").read_text())
        name = summary["config_hash"]
        if run_dir.name == name:
            continue
        target = stage_dir / name
        if target.exists():
            kept = json.loads((target / "summary.json").read_text())
            same = {k: v for k, v in kept.items() if k not in ("wall_time", "copied_from", "machine")} == \
                {k: v for k, v in summary.items() if k not in ("wall_time", "copied_from", "machine")}
            if not same:
                raise ValueError(f"{run_dir} and {target} share the config hash {name} but not their numbers")
            shutil.rmtree(run_dir)
        else:
            run_dir.rename(target)
        moved[run_dir.name] = name
    for run_dir in sorted(p for p in stage_dir.iterdir() if p.is_dir() and not (p / "summary.json").exists()
                          and (p / "config.yaml").is_file() and any(p.glob("checkpoint*.pt"))):
        # A run stopped part-way: its checkpoints resume under its hash, as the runner will look for it.
        target = stage_dir / config_hash(OmegaConf.load(run_dir / "config.yaml"))
        if run_dir != target and not target.exists():
            run_dir.rename(target)
    points = {f"(recorded as {old})": new for old, new in moved.items()}
    points.update({f"(recorded as {p.name})": p.name for p in finished_runs(stage_dir) if p.name not in moved.values()})
    if not (stage_dir / INDEX).is_file():
        atomic_write_text(stage_dir / INDEX, json.dumps({"version": 1, "points": points}, indent=1) + "\n")
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description="Pack, restore or migrate the run records of experiment specs.")
    parser.add_argument("specs", type=Path, nargs="+", help="spec run folders, runs/<spec>")
    parser.add_argument("--results", type=Path, default=None,
                        help="the results/ folder holding <spec>/records/ (default: beside runs/)")
    parser.add_argument("--migrate", action="store_true",
                        help="first rename run folders to their config hash and write each stage's index")
    parser.add_argument("--unpack", action="store_true", help="restore the runs from the records instead")
    args = parser.parse_args()
    for spec_dir in args.specs:
        records_dir = (args.results or spec_dir.resolve().parent.parent / "results") / spec_dir.name / "records"
        if args.unpack:
            print(f"{spec_dir.name}: {unpack(records_dir, spec_dir)} runs restored", file=sys.stderr)
            continue
        if args.migrate:
            for stage_dir in stage_dirs(spec_dir).values():
                migrate_stage(stage_dir)
        counts = pack_spec(spec_dir, records_dir)
        print(f"{spec_dir.name}: packed " + ", ".join(f"{n} {stage}" for stage, n in counts.items())
              + f" into {records_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
