"""Tables and plots from finished runs: `distlion-report runs/demo --out results/demo`.

Reads every `summary.json` (and its `metrics.jsonl`) under a sweep directory. Runs that differ only by
seed form a group (mean ± std over seeds, with n); groups differ in the settings that vary across the
runs (method, workers, per-worker batch, lr, method settings, ...), and tables, legends and line styles
name every one of them. The numbers are the task's declared metrics (`Task.metrics`), headline (a test
metric) first, each titled with its split. Writes a Markdown table, CSVs of every run and every
evaluation, PNG plots (the final headline metric against bits per parameter per iteration and the
number of workers; the validation metric logged during training against cumulative communicated bits
per parameter and training steps; the train loss: mean over seeds with a ±1 std band) and a static HTML page.

Time to target: each task names a validation target (`target` in conf/task/<task>.yaml, recorded in a run's
config.yaml; a spec or `--target` may override it). For every run, the step, wall time and cumulative bits
per parameter at its first validation evaluation that reaches it (`first_reaching`), and per group their
mean ± std over the seeds that reached it, counting those that did not.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
from omegaconf import OmegaConf

from distlion.cli import read_failures
from distlion.comm.voting import chance_agreement
from distlion.costmodel import steady_lines
from distlion.methods import label_order, method_label
from distlion.pages import Figure, Table, interactive_chart, render_index, render_page
from distlion.tasks import TASK_CONFIGS, Metric, task_metrics, task_name
from distlion.tasks.base import quantity

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

# Summary keys that are settings of a run, in the order tables and legends name them; every "method.<k>"
# comes after lr. The other keys are outcomes (metrics, bits, time) or bookkeeping (seed, hashes).
SETTINGS = ("label", "workers", "per_worker_batch", "lr", "task", "link", "shards", "shard_alpha", "faults_kind",
            "faults_k", "final_sync", "global_batch", "steps", "epochs", "num_params")
# The method always, workers and per-worker batch whenever they vary (the table's fixed columns). Any other
# setting is named only when it varies and the ones before it do not fix its value: tuned lr and weight
# decay follow from the method, steps at a fixed epoch count from the workers.
ALWAYS_NAMED = ("label", "workers", "per_worker_batch")
_SHOWN = {"workers": "N={}", "per_worker_batch": "batch {}/worker", "lr": "lr={:g}", "link": "link {}",
          "faults_kind": "faults: {}", "faults_k": "k={}", "shards": "{} shards", "shard_alpha": "alpha={:g}",
          "final_sync": "final sync {}", "global_batch": "global batch {}",
          "steps": "{} steps", "epochs": "{:g} epochs", "num_params": "{:,} params"}
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = "osD^v<>pPX*h"

Run = dict[str, Any]


def _seeds(groups: dict[tuple, list[Run]]) -> str:
    ns = sorted({len(members) for members in groups.values()})
    return f"n = {ns[0]} seed{'s' if ns[0] > 1 else ''} per group" if len(ns) == 1 else \
        f"n = {ns[0]} to {ns[-1]} seeds per group"


def chart_points(runs: list[Run], x: Callable[[list[Run]], float] | None = None) -> list[dict[str, Any]]:
    """Per group: the final headline metric (mean, std, n) against `x` of its runs (default: their bits per
    parameter per iteration), for an interactive chart (`distlion.pages.interactive_chart`; log x: x > 0 only)."""
    metric, keys = report_metrics(runs)[0], varying_keys(runs)
    x = x or (lambda members: _mean(members, "bits_per_param_per_iter"))
    points = []
    for values, members in group_runs(runs, keys).items():
        scores = [metric.scale * v for v in _values(members, metric.key)]
        if scores and x(members) > 0:
            points.append({"method": members[0]["label"], "settings": legend_text(keys, values),
                           "x": x(members), "y": statistics.mean(scores),
                           "std": statistics.stdev(scores) if len(scores) > 1 else 0.0, "n": len(scores),
                           "shown": _fmt(metric, _values(members, metric.key))})
    return points


def captions(runs: list[Run]) -> dict[str, str]:
    """What each plot shows and over how many seeds, for its caption."""
    curve, headline = curve_metric(runs), report_metrics(runs)[0]
    seeds = _seeds(group_runs(runs))
    band = f"one line per group, the mean over its seeds with a ±1 std band ({seeds})"
    bars = f"mean ± std over seeds ({seeds})"
    return {
        "metric_vs_faults.png": f"Final {headline.display} against the number k of faulty workers, one panel per "
                                f"fault kind, one line per method; {bars}.",
        "metric_vs_bits.png": f"{curve.display} logged during training against the cumulative bits per parameter "
                              f"each worker communicated (up + down, log scale); {band}.",
        "metric_vs_workers.png": f"Final {headline.display} against the number of workers, one line per group of "
                                 f"the other settings; {bars}.",
        "metric_vs_time.png": f"{curve.display} against wall-clock seconds (evaluations included); {band}.",
        "metric_vs_bits_per_iter.png": f"The paper's figure: final {headline.display} against bits per parameter "
                                       f"per iteration (up + down, log scale); {bars}.",
        "metric_curves.png": f"{curve.display} against training steps; {band}.",
        "loss_curves.png": f"Train loss against epochs; {band}.",
        "vote_agreement.png": "The sign methods' vote agreement (the share of workers' signs equal to the voted "
                              f"sign) against steps, beside what N fair coins would give (gray); {band}.",
        "worker_drift.png": f"The local-update methods' worker drift (mean L2 distance of the workers' parameters "
                            f"from their average) against steps; {band}.",
    }


def load_runs(root: Path) -> list[Run]:
    """Every finished run under `root` (those its index lists, where it has one), with its evaluations and logged
    steps under "curve", its method's label, its task's readable name and its declared metrics (from the summary, or
    for summaries written before the validation split, the `eval_*` ones of the task's class)."""
    runs = []
    index = root / "index.json"  # the spec's points as it is now (distlion.experiment.write_index)
    listed = set(json.loads(index.read_text())["points"].values()) if index.is_file() else None
    for path in sorted(root.rglob("summary.json")):
        run = json.loads(path.read_text())
        if listed is not None and run.get("config_hash") not in listed:
            continue  # a run of an earlier grid or seed list, kept in the folder but not in the spec's tables
        metrics = path.parent / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        run["curve"] = [json.loads(line) for line in lines if line]
        run["run_dir"] = str(path.parent)
        hparams = {k.removeprefix("method."): v for k, v in run.items() if k.startswith("method.")}
        run["label"] = method_label(run["method"], hparams)
        run["metrics"] = (tuple(Metric(**m) for m in run["metrics"]) if "metrics" in run
                          else task_metrics(run["task"], legacy=True))
        run["task"] = task_name(run["task"])
        run.setdefault("faults_k", 0)  # runs made before faulty workers had honest ones
        run.setdefault("faults_kind", None)
        run.setdefault("shards", "iid")  # and IID shards
        config = path.parent / "config.yaml"
        task_cfg = OmegaConf.load(config).get("task", {}) if config.exists() else {}
        run["backend"] = OmegaConf.load(config).get("cluster", {}).get("backend", "simulated") if config.exists() \
            else "simulated"
        run["data"] = task_cfg.get("data")
        run["val_examples"] = task_cfg.get("val_examples")
        target = task_cfg.get("target")
        run["config_target"] = OmegaConf.to_container(target) if target is not None else None
        runs.append(run)
    if not runs:
        raise FileNotFoundError(f"no finished run (summary.json) under {root}; run the sweep first")
    return runs


def report_metrics(runs: list[Run]) -> tuple[Metric, ...]:
    """The metrics the runs' task declares, headline first. Runs of tasks with other metrics cannot share
    the table's columns; runs of tasks with the same ones are told apart by their task as by any setting."""
    if len({tuple(m.key for m in r["metrics"]) for r in runs}) > 1:
        tasks = ", ".join(sorted({r["task"] for r in runs}))
        raise ValueError(f"the runs' tasks ({tasks}) declare different metrics; report them one task at a time")
    return runs[0]["metrics"]


def curve_metric(runs: list[Run]) -> Metric:
    """The metric logged during training, which curves plot: the headline's quantity on the validation split
    (the headline itself for runs from before the validation split, whose evaluations read one split)."""
    metrics = report_metrics(runs)
    headline = metrics[0]
    return next((m for m in metrics if m.split == "validation" and not m.reference and m.quantity == headline.quantity),
                headline)


def _value(run: Run, key: str) -> Any:
    value = run.get(key)
    return tuple(value) if isinstance(value, list) else value  # hashable: betas are lists in JSON


def _determined(runs: list[Run], keys: list[str], key: str) -> bool:
    """Whether the values of `keys` fix the value of `key` in every run."""
    seen: dict[tuple, Any] = {}
    return all(seen.setdefault(tuple(_value(r, k) for k in keys), _value(r, key)) == _value(r, key) for r in runs)


def varying_keys(runs: list[Run]) -> list[str]:
    """The settings that tell groups of runs apart: "label" first, then each one that varies (see ALWAYS_NAMED).
    Grouping by these is grouping by every varying setting: a key left out is fixed by the keys before it."""
    method_keys = sorted({k for r in runs for k in r if k.startswith("method.")})
    candidates = [*SETTINGS[:4], *method_keys, *SETTINGS[4:]]  # method settings after lr
    keys = ["label"]
    for key in candidates[1:]:
        if len({_value(r, key) for r in runs}) > 1 and (key in ALWAYS_NAMED or not _determined(runs, keys, key)):
            keys.append(key)
    return keys


def _sortable(value: Any) -> tuple:
    if value is None:
        return (2, "")
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


def _group_order(keys: list[str], values: tuple) -> tuple:
    return tuple((label_order(v), v) if k == "label" else _sortable(v) for k, v in zip(keys, values))


def group_runs(runs: list[Run], keys: list[str] | None = None) -> dict[tuple, list[Run]]:
    """Runs grouped by the values of `keys` (default: `varying_keys`), in the registry's method order."""
    keys = varying_keys(runs) if keys is None else keys
    groups: dict[tuple, list[Run]] = defaultdict(list)
    for r in runs:
        groups[tuple(_value(r, k) for k in keys)].append(r)
    return dict(sorted(groups.items(), key=lambda kv: _group_order(keys, kv[0])))


def _show(key: str, value: Any) -> str:
    if key == "label":
        return str(value)
    return _SHOWN[key].format(value) if key in _SHOWN else f"{key.removeprefix('method.')}={value}"


def legend_text(keys: list[str], values: tuple) -> str:
    """A group's name: "G-Lion, N=2, batch 16/worker"; a setting the method does not have (None) is left out."""
    return ", ".join(_show(k, v) for k, v in zip(keys, values) if v is not None)


def _column(key: str, value: Any) -> str:
    if value is None:  # a setting this method does not have (DiLoCo's sync_every in G-AdamW's row)
        return "—"
    return f"{value:g}" if key == "lr" else str(list(value) if isinstance(value, tuple) else value)


def _fmt(metric: Metric, values: list[float]) -> str:
    """Mean ± sample std over seeds (the value alone for one seed), in the metric's display units."""
    if not values:
        return "—"
    scaled = [metric.scale * v for v in values]
    if len(scaled) == 1:
        return f"{scaled[0]:.{metric.decimals}f}"
    return f"{statistics.mean(scaled):.{metric.decimals}f} ± {statistics.stdev(scaled):.{metric.decimals}f}"


def _values(members: Iterable[Run], key: str) -> list[float]:
    return [m[key] for m in members if m.get(key) is not None]


def _mean(members: list[Run], key: str) -> float:
    return statistics.mean(m[key] for m in members)


def references(runs: list[Run], drawn_on: str | None = None) -> list[tuple[Metric, float]]:
    """(reference metric, value) of the runs, e.g. the unigram entropy; only those drawn on the metric
    `drawn_on` (or on the same quantity of another split) if given."""
    return [(m, v) for m in report_metrics(runs)
            if m.reference and (drawn_on is None or quantity(drawn_on) == quantity(m.reference_for))
            for v in sorted(set(_values(runs, m.key)))]


def markdown_table(runs: list[Run]) -> Table:
    """One row per group: the settings, every declared score (mean ± std over seeds), n, and the mean bits
    (the sparse methods' differ across seeds), steps and wall time."""
    scores = [m for m in report_metrics(runs) if not m.reference]
    keys = varying_keys(runs)
    extra = [k for k in keys if k not in ALWAYS_NAMED]
    per_sync = any("bits_per_param_per_sync" in r for r in runs)  # local updates: the bits of one sync too
    header = ["method", "workers", "per-worker batch", *(k.removeprefix("method.").replace("_", " ") for k in extra),
              *(m.display for m in scores), "n", "bits/param/iter up", "down", "total",
              *(["bits/param/sync"] if per_sync else []), "total bits communicated", "steps", "wall time (min)"]
    rows = []
    for members in group_runs(runs, keys).values():
        r = members[0]
        cells = [r["label"], r["workers"], r["per_worker_batch"], *(_column(k, _value(r, k)) for k in extra),
                 *(_fmt(m, _values(members, m.key)) for m in scores), len(members),
                 *(f"{_mean(members, key):.3f}" for key in ("bits_up_per_param_per_iter",
                                                            "bits_down_per_param_per_iter", "bits_per_param_per_iter")),
                 *([f"{_mean(members, 'bits_per_param_per_sync'):.3f}" if "bits_per_param_per_sync" in r else "—"]
                   if per_sync else []),
                 f"{_mean(members, 'total_bits'):.3e}", r["steps"], f"{_mean(members, 'wall_time') / 60:.1f}"]
        rows.append(cells)
    notes = [f"Reference: the {m.display}, {value:.{m.decimals}f}{f' {m.note}' if m.note else ''}."
             for m, value in references(runs)]
    return Table(header, rows, notes=notes)


#: Seconds per step of each phase, as `distlion.train.StepClock` logs them.
PHASE_COLUMNS = {"time_compute": "compute", "time_encode": "encode", "time_comm": "communicate",
                 "time_comm_hidden": "of which hidden", "time_apply": "decode + apply", "time_step": "step"}


def steady_phase_times(run: Run, skip: int = 2) -> dict[str, float]:
    """A run's mean seconds per step of each phase over its steady state's logged lines (`steady_lines`)."""
    lines = steady_lines(run, run["curve"], skip)
    return {k: statistics.fmean(p.get(k, 0.0) for p in lines) for k in PHASE_COLUMNS} if lines else {}


def step_time_table(runs: list[Run]) -> Table | str:
    """Per group, the mean over seeds of each phase's seconds per step (empty for runs without step times)."""
    keys = varying_keys(runs)
    rows = []
    for values, members in group_runs(runs, keys).items():
        times = [t for t in (steady_phase_times(r) for r in members) if t]
        if times:
            cells = [f"{1e3 * statistics.fmean(t[k] for t in times):.1f}" for k in PHASE_COLUMNS]
            rows.append([legend_text(keys, values), *cells, len(times)])
    if not rows:
        return ""
    return Table(["run", *PHASE_COLUMNS.values(), "n"], rows,
                 "Milliseconds per step, by phase (mean over the logged steps after start-up, then over seeds; "
                 "communication hidden behind backward is part of `communicate` and not of `step`):")


def _between_syncs(run: Run) -> list[dict]:
    """The run's evaluations that fall between syncs. At a sync step (every `method.sync_every`-th, and the
    last with `final_sync`) every worker holds the model that counts, so drift and gap are 0 by construction."""
    every, end = run.get("method.sync_every"), run["curve"][-1]["step"] if run["curve"] else 0
    if not every:
        return run["curve"]
    return [p for p in run["curve"] if p["step"] % every and not (p["step"] == end and run.get("final_sync"))]


def _averaging_gain(run: Run, key: str, local: str) -> float | None:
    """The model that counts minus the mean of the workers' own models (metric `key`), averaged over the
    evaluations between syncs that scored both on the same examples: all but the end, which scores the model
    that counts on the whole validation split and the workers' on `task.val_examples`."""
    end = run["curve"][-1]["step"] if run["curve"] else 0
    gaps = [p[key] - p[local] for p in _between_syncs(run) if local in p and p["step"] != end]
    return statistics.fmean(gaps) if gaps else None


def _mean_drift(run: Run) -> float | None:
    """The worker drift averaged over the run's evaluations between syncs (each at its own distance from the
    last sync)."""
    drifts = [p["worker_drift"] for p in _between_syncs(run) if "worker_drift" in p]
    return statistics.fmean(drifts) if drifts else None


def _late_agreement(run: Run) -> float | None:
    """The vote agreement averaged over the logged steps of the run's second half (the vote of a trained model)."""
    end = run["curve"][-1]["step"] if run["curve"] else 0
    late = [p["vote_agreement"] for p in run["curve"] if "vote_agreement" in p and 2 * p["step"] > end]
    return statistics.fmean(late) if late else None


def diagnostics_table(runs: list[Run]) -> Table | str:
    """What explains a local-update or voting method's score, per group (mean ± std over seeds; "" when no run
    logged either): what averaging the workers' models gains (`_averaging_gain`), their drift (`_mean_drift`) and
    the vote agreement late in the run (`_late_agreement`)."""
    metric = curve_metric(runs)
    local = f"{metric.key}_local_mean"
    keys = varying_keys(runs)
    rows = []
    for values, members in group_runs(runs, keys).items():
        gains = [g for g in (_averaging_gain(r, metric.key, local) for r in members) if g is not None]
        drifts = [d for d in (_mean_drift(r) for r in members) if d is not None]
        agreement = [100 * a for a in (_late_agreement(r) for r in members) if a is not None]
        if not (gains or drifts or agreement):
            continue
        chance = sorted({f"{100 * chance_agreement(r['workers']):.1f}" for r in members})
        cells = [legend_text(keys, values), _fmt(metric, gains), _mean_std(drifts, ".3g") if drifts else "—",
                 _mean_std(agreement, ".1f") if agreement else "—", ", ".join(chance) if agreement else "—",
                 len(members)]
        rows.append(cells)
    if not rows:
        return ""
    return Table(["run", "model that counts - workers' own", "worker drift", "vote agreement (%)", "chance (%)", "n"],
                 rows, "Diagnostics, mean ± std over seeds. Local updates: the model that counts minus the mean of the "
            f"workers' own models, in {metric.display} on the same validation examples, averaged over the "
            "evaluations before the end that scored both (`train.local_eval_every`); the worker drift (mean L2 "
            "distance of their parameters from their average) averaged over the evaluations. Both leave out the "
            "evaluations at a sync step, where every worker holds the model that counts (— when every one "
            "fell there). Sign methods: the "
            "vote agreement, the % of the workers' signs equal to the voted sign, averaged over the logged steps of "
            "the run's second half, beside what N independent fair signs would give (a coin-flip vote; above 50%, "
            "as the majority is made of the signs it is compared with):")


def pivot_table(runs: list[Run], columns: str = "workers") -> Table:
    """The paper's layout: one row per group of the other settings, one column per value of `columns`
    (the headline metric, mean ± std over seeds, n)."""
    metric = report_metrics(runs)[0]
    keys = [k for k in varying_keys(runs) if k != columns]
    values = sorted({_value(r, columns) for r in runs}, key=_sortable)
    rows = []
    for row, members in group_runs(runs, keys).items():
        cells = [[m for m in members if _value(m, columns) == v] for v in values]
        rows.append([legend_text(keys, row),
                     *(f"{_fmt(metric, _values(c, metric.key))} (n={len(c)})" if c else "—" for c in cells)])
    return Table(["method", *(f"{columns}={v}" for v in values)], rows,
                 f"{metric.display}, mean ± std over seeds (n):")


@dataclass(frozen=True)
class Paired:
    """The mean paired difference (method - reference) over seeds, in display units, with its 95% t-interval."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def resolved(self) -> bool:
        return self.n >= 2 and not (self.low <= 0.0 <= self.high)

    def show(self, decimals: int) -> str:
        if self.n < 2:
            return f"{self.mean:+.{decimals}f} (n={self.n}, no interval)"
        text = f"{self.mean:+.{decimals}f} [{self.low:+.{decimals}f}, {self.high:+.{decimals}f}] (n={self.n})"
        return text if self.resolved else text + " not resolved"


def paired(members: list[Run], reference: list[Run], metric: Metric) -> Paired | None:
    """Differences of runs at the same seed (same data order and initialisation), mean and 95% t-interval."""
    from scipy.stats import t

    ref = {r["seed"]: r[metric.key] for r in reference if r.get(metric.key) is not None}
    diffs = [metric.scale * (r[metric.key] - ref[r["seed"]]) for r in members
             if r.get(metric.key) is not None and r["seed"] in ref]
    if not diffs:
        return None
    mean = statistics.mean(diffs)
    if len(diffs) < 2:
        return Paired(mean, math.nan, math.nan, 1)
    half = t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return Paired(mean, mean - half, mean + half, len(diffs))


def paired_table(runs: list[Run], reference: str) -> tuple[Table | str, list[str]]:
    """Each method against `reference` (a label, e.g. G-AdamW) at each setting (workers, batch, ...): the mean paired
    difference in the headline metric over the seeds both ran, its 95% t-interval, "not resolved" where it covers 0;
    and the sentences saying where D-Lion loses, made from those marks. ("", []) when the reference did not run."""
    metric = report_metrics(runs)[0]
    keys = varying_keys(runs)
    setting_keys = [k for k in keys if k in SETTINGS and k not in ("label", "lr")]
    method_keys = [k for k in keys if k not in setting_keys]
    settings = group_runs(runs, setting_keys)
    if not any(r["label"] == reference for r in runs):
        return "", []
    better = "higher" if metric.higher_is_better else "lower"
    intro = (f"{metric.display}: each method minus {reference} at the same seed (same data order and "
             f"initialisation), mean and 95% t-interval over the seeds both ran; {better} is better; \"not "
             "resolved\" where the interval covers 0:")
    rows, sentences = [], []
    for row, members in group_runs([r for r in runs if r["label"] != reference], method_keys).items():
        cells = []
        for values, at in settings.items():
            ref = [r for r in at if r["label"] == reference]
            mine = [r for r in at if r in members]
            diff = paired(mine, ref, metric) if ref and mine else None
            cells.append(diff.show(metric.decimals) if diff else "—")
            if diff is None or not row[0].startswith("D-Lion"):
                continue
            where = legend_text(setting_keys, values) or "every setting"
            worse = diff.mean < 0 if metric.higher_is_better else diff.mean > 0
            if diff.resolved and worse:
                sentences.append(f"{legend_text(method_keys, row)} loses to {reference} at {where}: "
                                 f"{diff.show(metric.decimals)} {metric.display}.")
            elif not diff.resolved:
                shown = diff.show(metric.decimals).removesuffix(" not resolved")
                sentences.append(f"{legend_text(method_keys, row)} and {reference} are not told apart at {where}: "
                                 f"{shown}.")
        rows.append([legend_text(method_keys, row), *cells])
    header = ["method", *(legend_text(setting_keys, v) or "all" for v in settings)]
    return Table(header, rows, intro), sentences


def _fault_rows(runs: list[Run]) -> tuple[list[str], list[int], dict[tuple[str, str], dict[int, list[Run]]]]:
    """Runs with faulty workers by (method label, fault kind) and k; the honest runs (k = 0) of a method are the
    k = 0 cell of each of its kinds' rows."""
    kinds = sorted({r["faults_kind"] for r in runs if r.get("faults_k")})
    ks = sorted({r.get("faults_k") or 0 for r in runs})
    rows: dict[tuple[str, str], dict[int, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        for kind in ([r["faults_kind"]] if r.get("faults_k") else kinds):
            rows[(r["label"], kind)][r.get("faults_k") or 0].append(r)
    order = sorted(rows, key=lambda row: (label_order(row[0]), row[0], kinds.index(row[1])))
    return kinds, ks, {row: rows[row] for row in order}


def fault_table(runs: list[Run]) -> Table | str:
    """The headline metric against the number k of faulty workers: one row per method and fault kind (mean ± std
    over seeds, n); empty without faulty workers."""
    if not any(r.get("faults_k") for r in runs):
        return ""
    metric = report_metrics(runs)[0]
    kinds, ks, rows = _fault_rows(runs)
    workers = sorted({r["workers"] for r in runs})
    cells = [[label, kind, *(f"{_fmt(metric, _values(by_k[k], metric.key))} (n={len(by_k[k])})" if by_k.get(k)
                             else "—" for k in ks)] for (label, kind), by_k in rows.items()]
    return Table(["method", "faults", *(f"k={k}" for k in ks)], cells,
                 f"{metric.display} with k of the N={'/'.join(map(str, workers))} workers faulty (the last k; "
                 "`distlion.comm.faults` says what each kind sends), mean ± std over seeds (n); k=0: honest workers:",
                 align="ll" + "r" * len(ks))


def plot_metric_vs_faults(runs: list[Run], path: Path) -> None:
    """The final headline metric against k, one panel per fault kind, one line per method (mean ± std)."""
    metric = report_metrics(runs)[0]
    kinds, ks, rows = _fault_rows(runs)
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.6 * len(kinds), 3.6), sharey=True, squeeze=False)
    labels = sorted({label for label, _ in rows}, key=lambda x: (label_order(x), x))
    for ax, kind in zip(axes[0], kinds, strict=True):
        for i, label in enumerate(labels):
            by_k = rows.get((label, kind), {})
            points = [(k, *spread) for k in ks if (spread := _mean_spread(metric, by_k.get(k, []))) is not None]
            if points:
                xs, ys, es = zip(*points)
                ax.errorbar(xs, ys, yerr=es, capsize=3, marker=MARKERS[i % len(MARKERS)], label=label)
        ax.set_title(kind, fontsize=10)
        ax.set_xlabel("faulty workers k")
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric.display)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(_seeds_note(group_runs(runs), "error bars"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class Target:
    """A validation result to reach (AlgoPerf's question asked of the paper's bits): `metric` (a validation
    metric key; None = the task's objective) at least `value`, or at most when lower is better. `value`
    None: no target set yet. `source` says how the value was obtained."""

    metric: str | None = None
    value: float | None = None
    source: str = ""

    @classmethod
    def of(cls, setting: Target | Mapping[str, Any], where: str = "target") -> Target:
        """A target from a config mapping ({metric, value, source}); one clear error for anything else."""
        if isinstance(setting, Target):
            return setting
        if not isinstance(setting, Mapping):
            raise ValueError(f"{where}={setting!r} must be a mapping {{metric, value, source}}")
        unknown = set(setting) - {"metric", "value", "source"}
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}; it takes metric, value and source")
        value = setting.get("value")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value)):
            raise ValueError(f"{where}.value={value!r} must be a finite number, or null for none set")
        return cls(setting.get("metric"), None if value is None else float(value), str(setting.get("source") or ""))


def first_reaching(curve: list[dict[str, Any]], metric: str, value: float,
                   higher_is_better: bool) -> dict[str, Any] | None:
    """The first logged point whose `metric` reaches `value` (>= it, or <= when lower is better): its step,
    epoch, wall time, cumulative bits per parameter and metric value; None if no point does (a NaN never does)."""
    for point in curve:
        if metric not in point:
            continue  # a train-metric line between evaluations
        if point[metric] >= value if higher_is_better else point[metric] <= value:
            return {"step": point.get("step"), "epoch": point.get("epoch"), "wall_time": point.get("wall_time"),
                    "cum_bits_per_param": point.get("cum_bits_per_param"), metric: point[metric]}
    return None


def derive_target(runs: list[Run], label: str, fraction: float = 0.75, where: Mapping[str, Any] | None = None,
                  spec: str = "") -> tuple[str, Target]:
    """(task, target) as AlgoPerf sets one: the mean over seeds of the `label` runs' (tuned G-AdamW's) validation
    objective at their last evaluation at or before `fraction` of their steps. `where`: settings the runs must
    have (e.g. {"workers": 8}, the tuned point)."""
    where = dict(where or {})
    chosen = [r for r in runs if r["label"] == label and all(_value(r, k) == v for k, v in where.items())]
    if not chosen:
        raise ValueError(f"no finished {label} run with {where or 'any settings'} to derive a target from")
    if len({r["task"] for r in chosen}) > 1 or len({r["objective"] for r in chosen}) > 1:
        raise ValueError(f"the {label} runs with {where} span several tasks or objectives; narrow `where`")
    metric, values, at = chosen[0]["objective"], [], []
    for r in chosen:
        points = [p for p in r["curve"] if metric in p and p["step"] <= fraction * r["steps"]]
        if not points:
            raise ValueError(f"{r['run_dir']}: no evaluation of {metric} before {fraction:.0%} of its steps")
        values.append(points[-1][metric])
        at.append(points[-1]["step"])
    seeds = sorted(r["seed"] for r in chosen)
    settings = ", ".join(f"{k}={v}" for k, v in where.items())
    source = (f"mean over seeds {seeds} of tuned {label}'s {metric} at its last evaluation at or before "
              f"{fraction:.0%} of its {chosen[0]['steps']} steps (steps {sorted(set(at))}"
              + (f"; {settings}" if settings else "") + f"), spec {spec or '?'}: AlgoPerf's rule")
    return chosen[0]["task"], Target(metric, statistics.fmean(values), source)


def write_task_target(path: Path, target: Target) -> None:
    """Set `value` and `source` of the `target:` block of a task config, keeping its other lines and comments."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("target:")), None)
    if start is None:
        raise ValueError(f"{path} has no `target:` block to set")
    done = set()
    for i in range(start + 1, len(lines)):
        if not lines[i].startswith("  "):
            break
        key = lines[i].split(":", 1)[0].strip()
        if key == "value":
            lines[i], _ = f"  value: {target.value:.6g}", done.add(key)
        elif key == "source":
            lines[i], _ = f"  source: {json.dumps(target.source)}", done.add(key)
        elif key == "metric" and target.metric is not None:
            lines[i] = f"  metric: {target.metric}"
    if done != {"value", "source"}:
        raise ValueError(f"{path}: its target block lacks {sorted({'value', 'source'} - done)}")
    path.write_text("\n".join(lines) + "\n")


def _config_target(task: str) -> dict[str, Any] | None:
    """The `target` of conf/task/<task>.yaml as it is now (for runs made before targets were recorded)."""
    path = TASK_CONFIGS / f"{task}.yaml"
    target = OmegaConf.load(path).get("target") if path.exists() else None
    return OmegaConf.to_container(target) if target is not None else None


def task_targets(runs: list[Run], target: Target | Mapping[str, Any] | None = None) -> dict[str, Target]:
    """The target of each task of `runs`: `target` if given (a spec's or the command line's), else the one the
    runs' config.yaml recorded (`task.target`), else the task's config as it is now. Runs from before the
    validation split have none. A target's metric must be a validation metric the runs declare."""
    targets = {}
    for task in sorted({r["task"] for r in runs}):
        members = [r for r in runs if r["task"] == task]
        if target is not None:
            chosen = Target.of(target)
        elif any("objective" not in r for r in members):
            continue  # summaries from before the validation split: no validation curve to read
        else:
            recorded = {json.dumps(t, sort_keys=True): t for r in members
                        if (t := r["config_target"]) is not None and t.get("value") is not None}
            if len(recorded) > 1:
                raise ValueError(f"the {task} runs recorded different targets ({', '.join(recorded)}); "
                                 "pass one (write_report(target=...) or --target)")
            setting = next(iter(recorded.values()), None) or _config_target(task)
            if setting is None:
                continue
            chosen = Target.of(setting, where=f"task {task}'s target")
        metric = chosen.metric or members[0].get("objective") or curve_metric(members).key
        declared = {m.key: m for m in members[0]["metrics"]}
        if metric not in declared or declared[metric].split != "validation":
            valid = sorted(k for k, m in declared.items() if m.split == "validation" and not m.reference)
            raise ValueError(f"target metric {metric!r} of task {task} is not a validation metric it logs; "
                             f"choose one of {valid}")
        targets[task] = Target(metric, chosen.value, chosen.source)
    return targets


def _target_metric(run: Run, target: Target) -> Metric:
    return next(m for m in run["metrics"] if m.key == target.metric)


def reach_targets(runs: list[Run], targets: dict[str, Target]) -> None:
    """Store in each run with a set target its first point reaching it ("to_target", None if not reached)."""
    for r in runs:
        target = targets.get(r["task"])
        if target is not None and target.value is not None:
            r["target_metric"], r["target_value"] = target.metric, target.value
            r["to_target"] = first_reaching(r["curve"], target.metric, target.value,
                                            _target_metric(r, target).higher_is_better)


#: Per-run CSV columns of the time to target (empty when the target is not reached or not set).
TO_TARGET_COLUMNS = {"steps_to_target": "step", "wall_time_to_target": "wall_time",
                     "bits_to_target": "cum_bits_per_param"}


def _mean_std(values: list[float], spec: str) -> str:
    """Mean ± sample std (the value alone for one), "not reached" for none."""
    if not values:
        return "not reached"
    if len(values) == 1:
        return format(values[0], spec)
    return f"{format(statistics.mean(values), spec)} ± {format(statistics.stdev(values), spec)}"


def _target_text(task: str, target: Target, metric: Metric) -> str:
    value = f"{metric.scale * target.value:.{metric.decimals}f}" if target.value is not None else "none set yet"
    sign = "≥" if metric.higher_is_better else "≤"
    source = f" ({target.source.strip()})" if target.source.strip() else ""
    return f"{task}: {metric.display} {sign} {value}{source}"


def _evaluations_text(runs: list[Run], targets: dict[str, Target]) -> str:
    """How finely the runs' evaluations resolve the time to target, and on how much of the validation split."""
    fractions = []
    for r in runs:
        steps = [p["step"] for p in r["curve"] if targets[r["task"]].metric in p and "step" in p]
        if steps and r.get("steps"):
            fractions.append(max(b - a for a, b in zip([0, *steps], steps)) / r["steps"])
    text = ""
    if fractions:
        low, high = f"{100 * min(fractions):.3g}%", f"{100 * max(fractions):.3g}%"
        text += f" Evaluations every {low if low == high else f'{low} to {high}'} of a run"
        text += (" (`train.num_evals` or `train.eval_every`): a run reached the target between the evaluation"
                 " given and the one before.")
    subsets = set()
    for r in runs:
        if r.get("splits"):
            size = f"{r['splits']['validation']:,} {r['splits'].get('unit', 'examples')}"
            examples = r.get("val_examples")
            subsets.add(f"{examples} evenly spaced validation examples of the {size} (`task.val_examples`), "
                        "the last evaluation on all" if examples else f"all {size} of the validation split")
    if subsets:
        text += f" Each evaluated on {'; '.join(sorted(subsets))}."
    return text


def time_to_target_table(runs: list[Run], targets: dict[str, Target]) -> Table | str:
    """Per group: n, how many seeds reached the target, and the step, wall time and cumulative bits per
    parameter at their first evaluation reaching it (mean ± std over those seeds). Call `reach_targets` first."""
    if not targets:
        return ""
    texts = [_target_text(task, t, _target_metric(next(r for r in runs if r["task"] == task), t))
             for task, t in targets.items()]
    lines = [f"Time to target, on the validation split. Target: {'; '.join(texts)}."]
    if all(t.value is None for t in targets.values()):
        return lines[0] + " Set `target.value` in the task's config (or a spec's `report.target`).\n"
    reached_runs = [r for r in runs if "to_target" in r]
    lines[0] += (" Per group: the step, wall time (evaluations included) and cumulative bits per parameter"
                 " communicated per worker (up + down) at a run's first validation evaluation that reaches the"
                 " target, mean ± std over the seeds that reached it; \"reached\" counts them out of n."
                 + _evaluations_text(reached_runs, targets) + "\n")
    keys = varying_keys(runs)
    extra = [k for k in keys if k not in ALWAYS_NAMED]
    header = ["method", "workers", "per-worker batch", *(k.removeprefix("method.").replace("_", " ") for k in extra),
              "n", "reached", "step", "wall time (s)", "bits/param (cumulative)"]
    rows = []
    for members in group_runs(reached_runs, keys).values():
        r, n = members[0], len(members)
        hits = [m["to_target"] for m in members if m["to_target"] is not None]
        reached = f"{len(hits)}/{n}" + (f" ({n - len(hits)}/{n} not reached)" if len(hits) < n else "")
        cells = [r["label"], r["workers"], r["per_worker_batch"], *(_column(k, _value(r, k)) for k in extra), n,
                 reached, _mean_std([h["step"] for h in hits], ".0f"),
                 _mean_std([h["wall_time"] for h in hits], ".1f"),
                 _mean_std([h["cum_bits_per_param"] for h in hits], ",.1f")]
        rows.append(cells)
    return Table(header, rows, lines[0])


def fewshot_table(runs: list[Run]) -> Table | str:
    """Per group and few-shot task (`eval.tasks`, see `distlion.tasks.fewshot`): accuracy in % as mean ± std over
    seeds, lm-eval's stderr of one run's accuracy (mean over seeds), and chance; "" without few-shot scores."""
    tasks = sorted({k.removeprefix("fewshot_acc_") for r in runs for k in r if k.startswith("fewshot_acc_")
                    and not k.startswith(("fewshot_acc_norm_", "fewshot_acc_stderr_"))})
    if not tasks:
        return ""
    keys = varying_keys(runs)
    extra = [k for k in keys if k not in ALWAYS_NAMED]
    header = ["method", "workers", "per-worker batch", *(k.removeprefix("method.").replace("_", " ") for k in extra),
              "n", *(f"{t} acc (%)" for t in tasks)]
    intro = ("Few-shot accuracy (%) on the test text through lm-eval (`eval.tasks`): mean ± std over seeds, then "
             "in brackets lm-eval's stderr of one run's accuracy (mean over seeds); chance: "
             + ", ".join(f"{t} {100 * runs[0].get(f'fewshot_chance_{t}', float('nan')):.0f}%" for t in tasks) + ".")
    rows = []
    for members in group_runs(runs, keys).values():
        r = members[0]
        cells = [r["label"], r["workers"], r["per_worker_batch"], *(_column(k, _value(r, k)) for k in extra),
                 len(members)]
        for t in tasks:
            accs = [100 * m[f"fewshot_acc_{t}"] for m in members if f"fewshot_acc_{t}" in m]
            errs = [100 * m[f"fewshot_acc_stderr_{t}"] for m in members if f"fewshot_acc_stderr_{t}" in m]
            cells.append(f"{_mean_std(accs, '.1f')} [{statistics.fmean(errs):.1f}]" if accs else "")
        rows.append(cells)
    return Table(header, rows, intro)


def hparams_table(runs: list[Run]) -> Table:
    """The hyperparameters each method actually ran with, read from the runs' summaries."""
    rows: list[list[Any]] = []
    for r in sorted(runs, key=lambda r: (label_order(r["label"]), r["label"])):
        settings = ", ".join(
            f"{k.removeprefix('method.')}={v}" for k, v in sorted(r.items()) if k.startswith("method.")
        )
        row = [r["label"], f"{r['lr']:g}", settings]
        if row not in rows:
            rows.append(row)
    return Table(["method", "lr", "settings"], rows, "Hyperparameters, as run:", align="lrl")


def _csv_settings(runs: list[Run]) -> list[str]:
    keys = ["label", "method", "task", "workers", "per_worker_batch", "lr"]
    return keys + [k for k in varying_keys(runs) if k not in keys]


def _run_order(runs: list[Run]) -> list[Run]:
    keys = varying_keys(runs)
    return sorted(runs, key=lambda r: (_group_order(keys, tuple(_value(r, k) for k in keys)), r["seed"]))


def write_csv(runs: list[Run], path: Path) -> None:
    """One row per run, every declared metric; run_dir relative to the CSV's folder, so a committed CSV
    names no machine's paths."""
    fields = [*_csv_settings(runs), "seed", "steps", "epochs", *(m.key for m in report_metrics(runs)),
              "bits_up_per_param_per_iter", "bits_down_per_param_per_iter", "bits_per_param_per_iter",
              "cum_bits_per_param", "total_bits", "num_params", "wall_time", "target_metric", "target_value",
              *TO_TARGET_COLUMNS, "config_hash", "git_sha", "run_dir"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(fields)), extrasaction="ignore")
        writer.writeheader()
        for r in _run_order(runs):
            reached = r.get("to_target") or {}
            writer.writerow({**r, **{column: reached.get(key) for column, key in TO_TARGET_COLUMNS.items()},
                             "run_dir": os.path.relpath(r["run_dir"], path.parent)})


def write_evals_csv(runs: list[Run], path: Path) -> None:
    """One row per evaluation of every run (the numbers behind metric_curves.png; the test metrics are in the
    last row of a run only)."""
    metrics = [m.key for m in report_metrics(runs)]
    logged = curve_metric(runs).key
    settings = _csv_settings(runs)
    fields = [*settings, "seed", "step", "epoch", "cum_bits_per_param", *metrics, "wall_time"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in _run_order(runs):
            for point in r["curve"]:
                if logged in point:
                    # The run's settings over the point's own keys: a point's "lr" is the scheduled one.
                    writer.writerow({**point, **{k: r.get(k) for k in settings}, "seed": r["seed"]})


def line_styles(keys: list[str], groups: Iterable[tuple]) -> dict[tuple, dict[str, Any]]:
    """A look per group: colour by method, line style by the first other setting, marker by all other settings
    together, so no two groups look alike (up to 10 methods and 12 combinations of the other settings)."""
    groups = sorted(groups, key=lambda g: _group_order(keys, g))
    labels = list(dict.fromkeys(g[0] for g in groups))
    rests = sorted({g[1:] for g in groups}, key=lambda v: _group_order(keys[1:], v))
    firsts = sorted({g[1:2] for g in groups}, key=lambda v: _group_order(keys[1:2], v))
    cmap = plt.get_cmap("tab10")
    return {g: {"color": cmap(labels.index(g[0]) % 10), "ls": LINESTYLES[firsts.index(g[1:2]) % len(LINESTYLES)],
                "marker": MARKERS[rests.index(g[1:]) % len(MARKERS)]} for g in groups}


def _draw_references(ax: Axes, runs: list[Run], metric: Metric) -> None:
    """Reference values of `metric` (e.g. the unigram entropy on the validation loss) as gray lines."""
    for ref, value in references(runs, metric.key):
        ax.axhline(metric.scale * value, color="gray", ls="--", lw=1, label=f"{ref.display}: {value:.{ref.decimals}f}")


def save_plot(fig: Any, ax: Axes, path: Path, xlabel: str, ylabel: str) -> Axes:
    """Label, grid and legend (outside the axes) for every report plot, then write it to `path` and close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # runs without logged curves draw nothing
        # Outside the axes, so the legend never covers data however many groups there are.
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return ax


def mean_curve(members: list[Run], x: str, y: str) -> tuple[list[float], list[float], list[float]]:
    """The seeds' curves aligned on their logged steps: (mean x, mean y, sample std of y, 0 for one seed) at
    every step at which all seeds logged both. Aligned on the step, not on x, because x may differ across
    seeds at one step (cumulative bits of the sparse methods) and their points would then never coincide."""
    per_seed = [{p["step"]: (p[x], p[y]) for p in m["curve"] if x in p and y in p and "step" in p} for m in members]
    steps = sorted(set.intersection(*(set(points) for points in per_seed))) if per_seed else []
    xs = [statistics.mean(points[s][0] for points in per_seed) for s in steps]
    ys = [[points[s][1] for points in per_seed] for s in steps]
    return xs, [statistics.mean(v) for v in ys], [statistics.stdev(v) if len(v) > 1 else 0.0 for v in ys]


def _seeds_note(groups: dict[tuple, list[Run]], spread: str) -> str:
    """The plot's title: one seed per group, or the mean over n seeds with its `spread` (band, error bars)."""
    ns = sorted({len(members) for members in groups.values()})
    if ns == [1]:
        return "one seed per group"
    return f"mean over seeds (n = {', '.join(map(str, ns))} per group), {spread}: ±1 sample std"


def _plot_curves(runs: list[Run], path: Path, x: str, y: str, scale: float, xlabel: str, ylabel: str,
                 reference: Metric | None = None, log_x: bool = False,
                 levels: Iterable[tuple[float, str]] = ()) -> Axes:
    """One line per group: the mean over its seeds, with a ±1 std band when it has more than one; `levels`
    ((y, label), in plotted units) as gray lines."""
    keys = varying_keys(runs)
    groups = group_runs(runs, keys)
    styles = line_styles(keys, groups)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for values, members in groups.items():
        xs, means, stds = mean_curve(members, x, y)
        if not xs:
            continue
        ys = [scale * v for v in means]
        ax.plot(xs, ys, label=legend_text(keys, values), markevery=max(1, len(xs) // 10), markersize=4,
                lw=1, **styles[values])
        if len(members) > 1:
            ax.fill_between(xs, [v - scale * e for v, e in zip(ys, stds)], [v + scale * e for v, e in zip(ys, stds)],
                            color=styles[values]["color"], alpha=0.2, lw=0)
    ax.set_title(_seeds_note(groups, "band"), fontsize=9)
    if reference is not None:
        _draw_references(ax, runs, reference)
    for (level, label), style in zip(levels, LINESTYLES[1:] * 4):
        ax.axhline(level, color="gray", ls=style, lw=1, label=label)
    if log_x:
        ax.set_xscale("log")
    return save_plot(fig, ax, path, xlabel, ylabel)


def plot_metric_curves(runs: list[Run], path: Path) -> Axes:
    """The validation metric logged during training against training steps, one line per group (mean over seeds)."""
    metric = curve_metric(runs)
    return _plot_curves(runs, path, "step", metric.key, metric.scale, "step", metric.display, reference=metric)


def plot_metric_vs_bits(runs: list[Run], path: Path) -> Axes:
    """The validation metric logged during training against cumulative bits per parameter (uplink + downlink,
    per worker), log x."""
    metric = curve_metric(runs)
    return _plot_curves(runs, path, "cum_bits_per_param", metric.key, metric.scale,
                        "cumulative bits per parameter communicated per worker (up + down)", metric.display,
                        reference=metric, log_x=True)


def plot_metric_vs_time(runs: list[Run], path: Path) -> Axes:
    """The validation metric logged during training against wall-clock seconds (evaluations included)."""
    metric = curve_metric(runs)
    return _plot_curves(runs, path, "wall_time", metric.key, metric.scale, "wall-clock time (s, evaluations included)",
                        metric.display, reference=metric)


def plot_loss_curves(runs: list[Run], path: Path) -> Axes:
    """Train loss against epochs, one line per group (mean over seeds)."""
    return _plot_curves(runs, path, "epoch", "train_loss", 1.0, "epoch", "train loss")


def plot_vote_agreement(runs: list[Run], path: Path) -> Axes | None:
    """The sign methods' vote agreement (the fraction of workers' signs equal to the voted sign) against steps; None
    when no run logged it. A gray line at the agreement of N independent fair signs (`chance_agreement`), which is
    above 50%: a vote near it is a coin flip."""
    voting = [r for r in runs if any("vote_agreement" in p for p in r["curve"])]
    if not voting:
        return None
    chance = [(100 * chance_agreement(n), f"chance: {n} independent fair signs, {100 * chance_agreement(n):.1f}%")
              for n in sorted({r["workers"] for r in voting})]
    return _plot_curves(voting, path, "step", "vote_agreement", 100.0, "step", "workers' signs equal to the vote (%)",
                        levels=chance)


def plot_worker_drift(runs: list[Run], path: Path) -> Axes | None:
    """The local-update methods' worker drift (mean L2 distance of the workers' parameters from their average)
    against steps; None when no run logged it."""
    local = [r for r in runs if any("worker_drift" in p for p in r["curve"])]
    if not local:
        return None
    return _plot_curves(local, path, "step", "worker_drift", 1.0, "step", "worker drift (mean L2 from the average)")


def _mean_spread(metric: Metric, members: list[Run]) -> tuple[float, float] | None:
    """Mean and sample std (0 for one seed) of the seeds' final `metric`; None when no seed has it (a tuning
    trial skips the test split)."""
    values = [metric.scale * v for v in _values(members, metric.key)]
    if not values:
        return None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def plot_metric_vs_bits_per_iter(runs: list[Run], path: Path) -> Axes:
    """The paper's figure: final headline metric against bits per parameter per iteration (up + down), log x."""
    metric = report_metrics(runs)[0]
    keys = varying_keys(runs)
    groups = group_runs(runs, keys)
    styles = line_styles(keys, groups)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for values, members in groups.items():
        if (point := _mean_spread(metric, members)) is None:
            continue
        mean, spread = point
        # The mean bits: the sparse methods' bits differ across seeds.
        ax.errorbar(statistics.mean(m["bits_per_param_per_iter"] for m in members), mean, yerr=spread, capsize=3,
                    label=legend_text(keys, values), **{**styles[values], "ls": "none"})
    _draw_references(ax, runs, metric)
    ax.set_title(_seeds_note(groups, "error bars"), fontsize=9)
    ax.set_xscale("log", base=2)
    return save_plot(fig, ax, path, "bits per parameter per iteration (worker -> server + server -> worker)",
                     metric.display)


def plot_metric_vs_workers(runs: list[Run], path: Path) -> Axes:
    """The final headline metric against workers: one line per group of the other settings (mean ± std)."""
    metric = report_metrics(runs)[0]
    keys = [k for k in varying_keys(runs) if k != "workers"]
    lines = group_runs(runs, keys)
    styles = line_styles(keys, lines)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for values, members in lines.items():
        points = [(workers, *spread) for (workers,), seeds in group_runs(members, ["workers"]).items()
                  if (spread := _mean_spread(metric, seeds)) is not None]
        if not points:
            continue
        xs, ys, es = zip(*points)
        ax.errorbar(xs, ys, yerr=es, capsize=3, label=legend_text(keys, values), **styles[values])
    ax.set_title(_seeds_note(group_runs(runs), "error bars"), fontsize=9)
    ax.set_xscale("log", base=2)
    return save_plot(fig, ax, path, "workers", metric.display)


def _intro(runs: list[Run]) -> str:
    """Which runs, of which task and data, and which split each metric comes from."""
    task = ", ".join(sorted({r["task"] for r in runs}))
    data = sorted({str(r["data"]) for r in runs if r["data"] not in (None, r["task"])})
    if data:
        task += f" (data: {', '.join(data)})"
    by_split: dict[str, list[str]] = defaultdict(list)
    for m in report_metrics(runs):
        if not m.reference:
            by_split[m.split].append(m.display)
    splits = "; ".join(f"{' and '.join(names)} on the {split} split" for split, names in by_split.items())
    text = (f"{len(runs)} runs of task {task}, seeds {sorted({r['seed'] for r in runs})}. Metrics from an "
            f"evaluation at the end of training: {splits}.")
    logged = curve_metric(runs)
    if logged != report_metrics(runs)[0]:
        text += (f" Curves: the {logged.display}, evaluated during training; the test split is evaluated once, "
                 "at the end.")
    sizes = sorted({_split_sizes(r["splits"]) for r in runs if r.get("splits")})
    if sizes:
        text += f" Splits (train / validation / test): {'; '.join(sizes)}."
    return text + " Bits are counted from the messages each method built.\n"


def _split_sizes(splits: dict[str, Any]) -> str:
    """"45,000 / 5,000 / 10,000 images, stratified, seed 0" from a summary's "splits"."""
    text = " / ".join(f"{splits[s]:,}" for s in ("train", "validation", "test")) + f" {splits.get('unit', 'examples')}"
    if splits.get("stratified"):
        text += ", stratified"
    if splits.get("seed") is not None:
        text += f", seed {splits['seed']}"
    if splits.get("val_fraction") is not None:
        text += f", validation the last {splits['val_fraction']:g} of each training document"
    return text


def failures_list(failures: list[dict[str, Any]]) -> str:
    """The failed runs (not in the tables), each with its one-line reason."""
    lines = [f"- `{Path(f['run_dir']).name}`: {f['reason']}" for f in failures]
    return f"**{len(failures)} failed run(s)**, not in the tables below:\n\n" + "\n".join(lines) + "\n"


# The code a run's numbers depend on beyond its config: runs of commits that differ here may not compare.
NUMBERS_CODE = ("distlion/methods", "distlion/comm", "distlion/kernels", "distlion/tasks", "distlion/optim.py",
                "distlion/flat.py", "distlion/schedule.py", *(f"distlion/cluster/{name}.py" for name in (
                    "base", "ddp", "grads", "sampler", "simulated", "torchdist")))
REPO = Path(__file__).resolve().parent.parent


class ProvenanceError(ValueError):
    """A table `--strict` refuses: dirty runs, or runs of commits whose method or task code differs."""


def _changed_code(commits: list[str]) -> list[str] | None:
    """The files of `NUMBERS_CODE` that differ between the first commit and each other one; None when a commit is
    not in this repository (the check cannot be made here)."""
    changed: set[str] = set()
    for commit in commits[1:]:
        done = subprocess.run(["git", "diff", "--name-only", commits[0], commit, "--", *NUMBERS_CODE], cwd=REPO,
                              capture_output=True, text=True)
        if done.returncode != 0:
            return None
        changed.update(done.stdout.split())
    return sorted(changed)


def provenance(runs: list[Run]) -> tuple[str, list[str]]:
    """The report's provenance paragraph (commits, dirty runs, machines) and what `--strict` refuses in it."""
    commits = sorted({r.get("git_sha") or "unknown" for r in runs})
    dirty = [r for r in runs if r.get("git_dirty")]
    problems = []
    text = (f"Provenance: {len(runs)} runs of {len(commits)} commit(s) ("
            + ", ".join(f"`{c[:7]}`: {sum((r.get('git_sha') or 'unknown') == c for r in runs)}" for c in commits) + ")")
    if dirty:
        problems.append(f"{len(dirty)} of {len(runs)} runs record git_dirty: true (their code may differ from "
                        "their commit)")
    known = [c for c in commits if c != "unknown"]
    if len(commits) > 1:
        changed = _changed_code(known) if len(known) == len(commits) else None
        if changed is None:
            problems.append("runs of several commits, some not in this repository: whether their method and task "
                            "code differs cannot be checked here")
        elif changed:
            problems.append(f"runs of several commits whose method or task code differs ({', '.join(changed[:6])}"
                            + (", ..." if len(changed) > 6 else "") + ")")
        else:
            text += "; the method and task code is the same in all"
    machines = sorted({(r.get("machine") or {}).get("cpu") or "not recorded" for r in runs})
    text += f". CPU: {'; '.join(machines)}."
    if problems:
        text += " **Not a clean table: " + "; ".join(problems) + ".**"
    return text + "\n", problems


def write_report(
    root: Path, out: Path, command: str | None = None, columns: str | None = None, notes: str | None = None,
    target: Target | Mapping[str, Any] | None = None, strict: bool = False, reference: str | None = "G-AdamW",
    links: list[str] | None = None,
) -> list[Run]:
    """Tables, CSVs, plots and a static HTML page for the runs under `root`, written into `out`. `target`
    ({metric, value, source}, e.g. a spec's `report.target`) overrides the targets the runs' configs name.
    `strict`: refuse (ProvenanceError, nothing written) a table of dirty runs or of commits whose code differs.
    `reference`: the method label every other is compared with, seed by seed (None: no comparison). `links`:
    link rates (e.g. "100mbit") whose modelled training time the page also charts (`distlion.wallclock`)."""
    runs = load_runs(root)
    origin, problems = provenance(runs)
    if strict and problems:
        raise ProvenanceError(f"--strict: {'; '.join(problems)}; rerun them from one clean commit")
    targets = task_targets(runs, target)
    reach_targets(runs, targets)
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"# Results: {out.name}\n"]
    if notes:
        parts.append(notes.strip() + "\n")
    if command:
        parts.append(f"Produced by:\n\n```\n{command}\n```\n")
    parts.append(_intro(runs))
    parts.append(origin)
    failures = read_failures(root)
    if failures:
        parts.append(failures_list(failures))
    inexact = [r for r in runs if r.get("resume_inexact")]
    if inexact:
        parts.append(f"**{len(inexact)} run(s) resumed inexactly** (in the tables; each differs from an "
                     "uninterrupted run): " + "; ".join(f"`{Path(r['run_dir']).name}`: {r['resume_inexact']}"
                                                        for r in inexact) + "\n")
    if columns:
        parts.append(pivot_table(runs, columns))
    faults = fault_table(runs)
    if faults:
        parts.append(faults)
    parts.append(markdown_table(runs))
    comparison, sentences = paired_table(runs, reference) if reference else ("", [])
    if comparison:
        parts.append(comparison)
        if sentences:
            parts.append("Where D-Lion loses or is not told apart (generated from the intervals above):\n\n"
                         + "\n".join(f"- {line}" for line in sentences) + "\n")
    if targets:
        parts.append(time_to_target_table(runs, targets))
    diagnostics = diagnostics_table(runs)
    if diagnostics:
        parts.append(diagnostics)
    times = step_time_table(runs)
    if times:
        parts.append(times)
    fewshot = fewshot_table(runs)
    if fewshot:
        parts.append(fewshot)
    parts.append(hparams_table(runs))
    plot_metric_vs_bits(runs, out / "metric_vs_bits.png")
    plot_metric_vs_time(runs, out / "metric_vs_time.png")
    plot_metric_vs_bits_per_iter(runs, out / "metric_vs_bits_per_iter.png")
    plot_metric_curves(runs, out / "metric_curves.png")
    plot_loss_curves(runs, out / "loss_curves.png")
    plots = ["metric_vs_bits.png", "metric_vs_time.png", "metric_vs_bits_per_iter.png", "metric_curves.png",
             "loss_curves.png"]
    if len({r["workers"] for r in runs}) > 1:
        plot_metric_vs_workers(runs, out / "metric_vs_workers.png")
        plots.insert(1, "metric_vs_workers.png")
    if faults:
        plot_metric_vs_faults(runs, out / "metric_vs_faults.png")
        plots.insert(0, "metric_vs_faults.png")
    for name, plot in (("vote_agreement.png", plot_vote_agreement), ("worker_drift.png", plot_worker_drift)):
        if plot(runs, out / name) is not None:
            plots.append(name)
    shown = captions(runs)
    parts += [Figure(p, shown[p]) for p in plots]
    parts.append("Every run: `runs.csv`; every evaluation of every run: `evals.csv`.\n")
    markdown = "\n".join(str(part) for part in parts)
    (out / "results.md").write_text(markdown)
    write_csv(runs, out / "runs.csv")
    write_evals_csv(runs, out / "evals.csv")
    metric = report_metrics(runs)[0]
    chart = interactive_chart(chart_points(runs), "bits per parameter per iteration (up + down)", metric.display,
                              "accuracy-vs-bits")
    caption = (f"Interactive: final {metric.display} against bits per parameter per iteration, one point per group "
               f"(mean, bars ±1 std, {_seeds(group_runs(runs))}); hover a point for its settings, mean ± std and n.")
    charts = [(caption, chart)]
    if links:
        from distlion.wallclock import modelled_points  # it reads this module's groups: imported here

        for link in links:
            charts.append((
                f"Interactive: final {metric.display} against the modelled training time on {link} links (the cost "
                f"model, `modelled_time.md`), one point per group ({_seeds(group_runs(runs))}); hover for settings, "
                "mean ± std and n.",
                interactive_chart(modelled_points(runs, link), f"modelled training time on {link} links (s)",
                                  metric.display, f"accuracy-vs-time-{link}")))
    render_page(f"Results: {out.name}", parts[1:], out / "index.html", out / "README.md",  # [0]: the heading
                charts=charts)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, nargs="?", help="sweep directory holding run directories")
    parser.add_argument("--out", type=Path, help="where to write results.md, runs.csv and plots")
    parser.add_argument("--index", type=Path, metavar="RESULTS",
                        help="only write RESULTS/index.html: every experiment's headline and figure, linked")
    parser.add_argument("--strict", action="store_true",
                        help="refuse a table of dirty runs or of commits whose method or task code differs")
    parser.add_argument("--command", default=None, help="the command that produced the runs, recorded in results.md")
    parser.add_argument("--notes", default=None, help="a description written at the top of results.md")
    parser.add_argument("--columns", default=None,
                        help="a setting (e.g. workers) for a table with one column per value of it")
    parser.add_argument("--target", type=float, default=None,
                        help="a validation target value, over the tasks' configs (e.g. 0.9 for 90%% accuracy)")
    parser.add_argument("--target-metric", default=None,
                        help="the validation metric of --target (default: the task's objective, e.g. val_accuracy)")
    args = parser.parse_args()
    if args.index is not None:
        print(f"index of every experiment: {render_index(args.index)}")
        return
    if args.root is None or args.out is None:
        parser.error("give a sweep directory and --out (or --index RESULTS)")
    target = (Target(args.target_metric, args.target, "given on the command line (--target)")
              if args.target is not None else None)
    try:
        runs = write_report(args.root, args.out, args.command, columns=args.columns, notes=args.notes,
                            target=target, strict=args.strict)
    except ProvenanceError as err:
        raise SystemExit(f"distlion: error: {err}") from None
    print(markdown_table(runs))


if __name__ == "__main__":
    main()
