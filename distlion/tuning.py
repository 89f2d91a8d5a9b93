"""Tuning as part of a spec: `distlion-experiment experiments/demo.yaml --tune` (issue 13).

A spec's `tuning:` section declares, per method, a log range of the learning rate and, where searched, of
the weight decay or (Lion family, as Chen et al. recommend) of lr x wd; one grid density, one per-trial
budget and the trial seeds are common to every method, so each gets the same tuning effort per decade:

    tuning:
      objective: validation          # the runs' `objective` (their validation metric); never a test metric
      budget: {train.steps: 60}      # overrides of every trial, the same for every method
      seeds: [0]                     # trial seeds
      grid_points_per_decade: 2      # the same density for every method
      trials: 6                      # optional: refuse a method whose grid has another number of points
      sweep: cluster.workers=4       # optional: overrides of every trial (comma lists are tuned separately)
      spaces:
        adamw: {lr: [1e-3, 1e-2], weight_decay: [1e-3, 1e-1]}
        dlion: {lr: [1e-4, 1e-3], lr_x_wd: [1e-5, 1e-4]}   # weight_decay = lr_x_wd / lr

The grid runs as Hydra basic-sweeper multiruns through `distlion.experiment` (so `--jobs`, skipping
finished trials and surviving failed ones are the spec runner's) into `runs/<spec>/tuning/`, with
`train.test_eval=false`: a trial never evaluates the test split. Per task, method and any other setting
that varies across the trials, the point with the best mean validation objective over the trial seeds is
chosen (ties: the smaller lr, then the smaller weight decay). Written: `results/<spec>/tuning.md`, the
validation objective against lr (`tuning_<metric>_vs_lr.png`) and `conf/tuned/<task>_<method>.yaml` with
its provenance, unless the chosen point lies on the edge of its grid (widen the grid; `--accept-edge`).
"""

from __future__ import annotations

import datetime
import json
import math
import shlex
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import yaml
from omegaconf import OmegaConf

from distlion.cli import read_failures
from distlion.methods import label_order, variant_of

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SECOND_AXES = ("weight_decay", "lr_x_wd")
_SPEC_KEYS = {"objective", "budget", "seeds", "grid_points_per_decade", "trials", "sweep", "spaces"}
_TUNED_KEYS = ("method.lr", "method.weight_decay", "seed", "method=", "train.test_eval")

Point = tuple[float, float | None]  # (lr, weight decay); None: the method's configured weight decay


class SpecError(ValueError):
    """A tuning section that cannot give every method the same, honest search."""


def yaml_float(value: float) -> str:
    """`value` as YAML reads back a float (3 significant digits): "0.0", not "0", which is an int and would give
    the final runs another config hash than their trials."""
    text = f"{value:g}"
    return text if any(c in text for c in ".einf") else f"{text}.0"


def _round(value: float) -> float:
    return float(f"{value:.3g}")  # 3 significant digits: readable run directories and tuned files


def log_grid(lo: float, hi: float, per_decade: int) -> tuple[float, ...]:
    """`per_decade` log-spaced points per decade from lo to hi, both included (3 significant digits)."""
    if not (0 < lo <= hi) or not all(map(math.isfinite, (lo, hi))):
        raise SpecError(f"a range must be [lo, hi] with 0 < lo <= hi; got [{lo}, {hi}]")
    steps = per_decade * math.log10(hi / lo)
    if abs(steps - round(steps)) > 1e-6:  # else the last step would be shorter: an unequal density
        raise SpecError(f"[{lo:g}, {hi:g}] is not a whole number of grid steps of 1/{per_decade} decade")
    # Step from the exact point lo rounds (10^(k/per_decade)), not from lo itself: a grid moved by a step off
    # an edge then meets the trials it shares with the old one at the same values (4.64e-4 from 1e-4 or 2.15e-4).
    k = round(per_decade * math.log10(lo))
    if _round(10 ** (k / per_decade)) == _round(lo):
        lo = 10 ** (k / per_decade)
    return tuple(_round(lo * 10 ** (k / per_decade)) for k in range(round(steps) + 1))


@dataclass(frozen=True)
class Space:
    """One method's grid: lr, and the weight decay or lr x wd when searched."""

    method: str
    lr: tuple[float, ...]
    axis: str | None = None  # "weight_decay" | "lr_x_wd" | None (lr only)
    values: tuple[float, ...] = ()

    def points(self) -> list[Point]:
        if self.axis is None:
            return [(lr, None) for lr in self.lr]
        if self.axis == "weight_decay":
            return [(lr, wd) for lr in self.lr for wd in self.values]
        return [(lr, _round(p / lr)) for lr in self.lr for p in self.values]

    def coordinate(self, point: Point) -> float | None:
        """The point's value on the second axis: its weight decay, or the grid's lr x wd nearest to it."""
        lr, wd = point
        if self.axis is None or wd is None:
            return None
        if self.axis == "weight_decay":
            return wd
        return min(self.values, key=lambda p: abs(math.log(p) - math.log(lr * wd)) if wd > 0 else math.inf)

    def edges(self, point: Point) -> list[str]:
        """The axes on whose edge the point lies (an axis of one value is fixed, not searched)."""
        found = []
        for name, grid, value in (("lr", self.lr, point[0]), (self.axis, self.values, self.coordinate(point))):
            if name and len(grid) > 1 and value in (min(grid), max(grid)):
                found.append(f"{name}={value:g} is the {'lowest' if value == min(grid) else 'highest'} of its grid")
        return found

    def describe(self) -> str:
        text = f"lr {{{', '.join(f'{v:g}' for v in self.lr)}}}"
        if self.axis:
            name = "weight decay" if self.axis == "weight_decay" else "lr x wd"
            text += f" x {name} {{{', '.join(f'{v:g}' for v in self.values)}}}"
        return text


@dataclass(frozen=True)
class Tuning:
    objective: str  # "validation" (each run's declared objective) or a "val_*" key
    budget: tuple[str, ...]  # overrides of every trial
    seeds: tuple[int, ...]
    per_decade: int
    spaces: tuple[Space, ...]
    sweep: str = ""
    trials: int | None = None

    def space(self, method: str) -> Space | None:
        return next((s for s in self.spaces if s.method == method), None)

    def describe_budget(self) -> str:
        return " ".join(self.budget) or "the spec's training length"


def parse_tuning(spec: dict[str, Any]) -> Tuning:
    """The spec's `tuning:` section, checked: one budget, density and seed list for every method."""
    section = spec.get("tuning")
    if not isinstance(section, dict):
        raise SpecError("the spec has no `tuning:` section (see distlion/tuning.py for its format)")
    unknown = set(section) - _SPEC_KEYS
    if unknown:
        raise SpecError(f"tuning.{sorted(unknown)[0]} is not a tuning setting; use {sorted(_SPEC_KEYS)}")
    objective = str(section.get("objective", "validation"))
    if objective != "validation" and not objective.startswith("val_"):
        raise SpecError(f"tuning.objective={objective!r}: trials are selected by a validation metric "
                        "('validation' or a val_* key), never by the test split")
    budget = tuple(f"{k}={v}" for k, v in (section.get("budget") or {}).items())
    overrides = [*budget, *shlex.split(str(section.get("sweep", "")))]
    clash = [o for o in overrides if o.startswith(_TUNED_KEYS)]
    if clash:
        raise SpecError(f"tuning: {clash[0]} is set by the tuning itself (the grid, tuning.seeds)")
    per_decade = section.get("grid_points_per_decade")
    if not isinstance(per_decade, int) or per_decade < 1:
        raise SpecError("tuning.grid_points_per_decade must be a positive whole number, common to every method")
    spaces = []
    for method, ranges in (section.get("spaces") or {}).items():
        ranges = ranges or {}
        extra = set(ranges) - {"lr", *SECOND_AXES}
        if extra:  # a per-method budget or density would make the comparison unfair
            raise SpecError(f"tuning.spaces.{method}.{sorted(extra)[0]}: a method's space holds only lr and "
                            "weight_decay or lr_x_wd; the budget, density and seeds are the same for every method "
                            "(tuning.budget, tuning.grid_points_per_decade, tuning.seeds)")
        if "lr" not in ranges:
            raise SpecError(f"tuning.spaces.{method}: give an lr range [lo, hi]")
        axes = [a for a in SECOND_AXES if a in ranges]
        if len(axes) > 1:
            raise SpecError(f"tuning.spaces.{method}: search weight_decay or lr_x_wd, not both")
        try:
            lr = log_grid(*map(float, ranges["lr"]), per_decade)
            values = log_grid(*map(float, ranges[axes[0]]), per_decade) if axes else ()
        except (SpecError, TypeError) as err:
            raise SpecError(f"tuning.spaces.{method}: {err}") from None
        spaces.append(Space(method, lr, axes[0] if axes else None, values))
    if not spaces:
        raise SpecError("tuning.spaces: give at least one method's space")
    trials = section.get("trials")
    if trials is not None:
        uneven = {s.method: len(s.points()) for s in spaces if len(s.points()) != trials}
        if uneven:
            raise SpecError(f"tuning.trials={trials}, but these methods' grids have other sizes: {uneven}; "
                            "give every method the same number of trials")
    seeds = tuple(int(s) for s in section.get("seeds", [0]))
    return Tuning(objective, budget, seeds, per_decade, tuple(spaces), str(section.get("sweep", "")), trials)


def _join(values: list[float]) -> str:
    return ",".join(f"{v:g}" for v in values)


def trial_sweeps(tuning: Tuning) -> list[str]:
    """The grid as Hydra basic-sweeper overrides: one sweep per method, or per (method, lr) for lr x wd,
    whose weight decays depend on the lr (a sweep is a Cartesian product)."""
    sweeps = []
    for space in tuning.spaces:
        head = f"method={space.method} {tuning.sweep}".strip()
        if space.axis == "lr_x_wd":
            for lr in space.lr:
                decays = [wd for x, wd in space.points() if x == lr]
                sweeps.append(f"{head} method.lr={lr:g} method.weight_decay={_join(decays)}")
        else:
            wd = f" method.weight_decay={_join(list(space.values))}" if space.axis else ""
            sweeps.append(f"{head} method.lr={_join(list(space.lr))}{wd}")
    return sweeps


def trial_spec(spec: dict[str, Any], tuning: Tuning) -> dict[str, Any]:
    """A spec of the trials for `distlion.experiment.sweep_commands`: the budget, and no test evaluation."""
    return {"name": spec["name"], "base": [*spec.get("base", []), *tuning.budget, "train.test_eval=false"],
            "sweeps": trial_sweeps(tuning), "seeds": list(tuning.seeds)}


@dataclass
class Choice:
    """The trials of one task, method and setting of the other varying keys, and the point chosen."""

    task: str
    method: str  # the registered method (config option), e.g. "dlion_avg"
    label: str
    others: tuple[tuple[str, Any], ...]
    objective: str
    higher_is_better: bool
    scale: float
    space: Space | None
    trials: dict[Point, list[dict[str, Any]]] = field(default_factory=dict)
    best: Point | None = None
    edges: list[str] = field(default_factory=list)
    # Trials of earlier grids, budgets or seeds of the same method and settings: never chosen from, but
    # tuning effort this method had (a grid widened after an edge warning gives its method more trials).
    earlier: list[dict[str, Any]] = field(default_factory=list)

    def score(self, point: Point) -> float:
        values = [s.get(self.objective) for s in self.trials[point]]
        values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        return sum(values) / len(values) if values else math.nan

    @property
    def runs(self) -> list[dict[str, Any]]:
        return [s for seeds in self.trials.values() for s in seeds]

    @property
    def steps(self) -> int:
        return sum(s["steps"] for s in self.runs)

    @property
    def wall(self) -> float:
        return sum(s["wall_time"] for s in self.runs)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _objective(summary: dict[str, Any], objective: str) -> tuple[str, bool, float]:
    key = summary.get("objective") if objective == "validation" else objective
    metric = next((m for m in summary.get("metrics", []) if m["key"] == key), None)
    if metric is None or metric["split"] != "validation":
        raise SpecError(f"{summary.get('run_dir')}: no validation metric {key!r} to select by")
    return key, metric["higher_is_better"], metric.get("scale", 1.0)


def is_current(summary: dict[str, Any], tuning: Tuning, space: Space | None) -> bool:
    """Whether a finished trial belongs to the tuning as the spec is now: one of its seeds, a point of its grid
    and its budget (a runs folder keeps the trials of earlier grids and budgets, which must not be chosen)."""
    if summary.get("seed") not in tuning.seeds:
        return False
    if space is not None:
        wd = summary.get("method.weight_decay") or 0.0
        if not any(math.isclose(summary["lr"], lr, rel_tol=1e-6)
                   and (space.axis is None or math.isclose(wd, point_wd or 0.0, rel_tol=1e-6, abs_tol=1e-12))
                   for lr, point_wd in space.points()):
            return False
    config = Path(summary.get("run_dir", "")) / "config.yaml"
    if config.is_file():
        resolved = OmegaConf.load(config)
        for override in tuning.budget:
            key, _, value = override.partition("=")
            if OmegaConf.select(resolved, key) != yaml.safe_load(value):
                return False
    return True


def select(summaries: list[dict[str, Any]], tuning: Tuning) -> list[Choice]:
    """Group the trials' summaries by task, method and the other settings that vary, and choose in each the
    point with the best mean validation objective over seeds (never a test metric; ties: smaller lr, then
    smaller weight decay). Trials of earlier grids, budgets or seeds are left out."""
    choices: dict[tuple, Choice] = {}
    earlier: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for s in summaries:
        hparams = {k.removeprefix("method."): v for k, v in s.items() if k.startswith("method.")}
        info = variant_of(s["method"], hparams)
        others = tuple(sorted((k, _hashable(v)) for k, v in s.items()
                              if k in ("workers", "per_worker_batch") or
                              (k.startswith("method.") and k != "method.weight_decay")))
        key = (s["task"], info.name, others)
        if not is_current(s, tuning, tuning.space(info.name)):
            earlier[key].append(s)
            continue
        if key not in choices:
            objective, higher, scale = _objective(s, tuning.objective)
            choices[key] = Choice(s["task"], info.name, info.label, others, objective, higher, scale,
                                  tuning.space(info.name))
        point = (s["lr"], s.get("method.weight_decay"))
        choices[key].trials.setdefault(point, []).append(s)
    for key, c in choices.items():
        c.earlier = earlier.get(key, [])
        sign = 1.0 if c.higher_is_better else -1.0

        def rank(point: Point, c: Choice = c, sign: float = sign) -> tuple:
            score = c.score(point)
            return (math.isnan(score), -sign * score if not math.isnan(score) else 0.0, point[0], point[1] or 0.0)

        c.best = min(c.trials, key=rank)
        c.edges = c.space.edges(c.best) if c.space is not None else []
    return sorted(choices.values(), key=lambda c: (c.task, label_order(c.label), c.label, c.others))


def load_trials(root: Path) -> list[dict[str, Any]]:
    """The finished trials' summaries under `root`."""
    trials = []
    for path in sorted(root.rglob("summary.json")):
        summary = json.loads(path.read_text())
        summary["run_dir"] = str(path.parent)
        trials.append(summary)
    return trials


def kept_settings(path: Path) -> dict[str, Any]:
    """The method settings of an existing tuned file other than lr and weight decay (e.g. betas): the trials ran
    with them, so the rewritten file keeps them."""
    if not path.is_file():
        return {}
    method = (yaml.safe_load(path.read_text()) or {}).get("method") or {}
    return {k: v for k, v in method.items() if k not in ("lr", "weight_decay")}


def same_setting(path: Path, text: str) -> bool:
    """Whether the tuned file at `path` already holds the method settings of `text` (comments aside)."""
    if not path.is_file():
        return False
    return (yaml.safe_load(path.read_text()) or {}).get("method") == yaml.safe_load(text).get("method")


def tuned_text(c: Choice, spec_name: str, tuning: Tuning, command: str, date: str,
               kept: dict[str, Any] | None = None) -> str:
    """A conf/tuned file for the choice, its provenance in comments; `kept`: other method settings it keeps."""
    lr, wd = c.best
    trial = c.trials[c.best][0]
    wd = trial.get("method.weight_decay") if wd is None else wd
    lines = ["# @package _global_",
             f"# Tuned {date} by `{command}` (distlion.tuning): spec {spec_name}, {c.label} on {c.task}"
             + (f" ({', '.join(f'{k}={v}' for k, v in c.others if k in ('workers', 'per_worker_batch'))})"
                if c.others else "") + ".",
             f"# Objective: {c.objective} = {c.score(c.best):.6g} (mean over trial seeds {list(tuning.seeds)}), "
             f"at the end of each trial; budget per trial: {tuning.describe_budget()}.",
             f"# Grid ({tuning.per_decade} points per decade): {c.space.describe() if c.space else 'n/a'}; "
             f"{len(c.runs)} trials, {c.steps} trial-steps, {c.wall:.0f} s."]
    if c.edges:
        lines.append(f"# WARNING: accepted on the edge of its grid ({'; '.join(c.edges)}): widen the grid.")
    lines += ["method:", f"  lr: {yaml_float(lr)}"]
    if wd is not None:
        lines.append(f"  weight_decay: {yaml_float(wd)}")
    if kept:
        lines.append("  # kept from the file the trials ran with (not tuned here):")
        lines += [f"  {key}: {json.dumps(value)}" for key, value in kept.items()]  # JSON values are YAML
    return "\n".join(lines) + "\n"


def _plot(choices: list[Choice], path: Path) -> None:
    """The validation objective against lr, log x: one line per method and second-axis value, chosen point starred."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cmap = plt.get_cmap("tab10")
    styles = ("-", "--", ":", "-.")
    for i, c in enumerate(choices):
        lines: dict[Any, list[Point]] = defaultdict(list)
        for point in c.trials:
            lines[c.space.coordinate(point) if c.space else point[1]].append(point)
        for j, (second, points) in enumerate(sorted(lines.items(), key=lambda kv: kv[0] or 0.0)):
            points.sort()
            name = "" if second is None else (
                f", wd={second:g}" if c.space is None or c.space.axis == "weight_decay" else f", lr x wd={second:g}")
            ax.plot([p[0] for p in points], [c.scale * c.score(p) for p in points], marker="o", markersize=4,
                    color=cmap(i % 10), ls=styles[j % len(styles)], label=f"{c.label}{name}")
        ax.plot(c.best[0], c.scale * c.score(c.best), marker="*", markersize=14, color=cmap(i % 10),
                markeredgecolor="black", ls="none")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    metric = choices[0].objective
    ax.set_ylabel(f"{metric} at the end of the trial" + (" (%)" if choices[0].scale == 100 else ""))
    ax.set_title("tuning: validation objective against lr (star: chosen)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _trial_table(c: Choice) -> list[str]:
    second = {"weight_decay": "weight decay", "lr_x_wd": "lr x wd"}.get(c.space.axis if c.space else None)
    header = ["lr", "weight decay", *([second] if second == "lr x wd" else []), c.objective, "seeds", "steps",
              "wall (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for point in sorted(c.trials, key=lambda p: (p[0], p[1] or 0.0)):
        runs = c.trials[point]
        cells = [f"{point[0]:g}", "—" if point[1] is None else f"{point[1]:g}",
                 *([f"{c.space.coordinate(point):g}"] if second == "lr x wd" else []),
                 f"{c.scale * c.score(point):.4g}", str(len(runs)), str(sum(r["steps"] for r in runs)),
                 f"{sum(r['wall_time'] for r in runs):.1f}"]
        if point == c.best:
            cells = [f"**{cell}**" for cell in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _shown(c: Choice, choices: list[Choice]) -> str:
    """The choice's workers, batch and any method setting that tells it from the method's other choices."""
    varying = {k for d in choices if (d.task, d.method) == (c.task, c.method) for k, v in d.others
               if v != dict(c.others).get(k)}
    return ", ".join(f"{k.removeprefix('method.')}={v}" for k, v in c.others
                     if k in ("workers", "per_worker_batch") or k in varying) or "—"


def write_tuning(spec: dict[str, Any], tuning: Tuning, trials_dir: Path, results_dir: Path, command: str,
                 tuned_dir: Path | None, accept_edge: bool = False) -> list[Choice]:
    """tuning.md and the lr plot into `results_dir`; the chosen settings into `tuned_dir` (None: not written)."""
    choices = select(load_trials(trials_dir), tuning)
    failures = read_failures(trials_dir)
    if not choices:
        raise FileNotFoundError(f"no finished tuning trial under {trials_dir}")
    results_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    plot = f"tuning_{choices[0].objective}_vs_lr.png"
    _plot(choices, results_dir / plot)
    pairs = defaultdict(list)
    for c in choices:
        pairs[(c.task, c.method)].append(c)
    written = []
    lines = [f"# Tuning: {spec['name']}\n", f"Command: `{command}` ({date}).\n",
             f"Every method: the same budget per trial ({tuning.describe_budget()}), the same grid density "
             f"({tuning.per_decade} points per decade), trial seeds {list(tuning.seeds)}; selected by the "
             f"validation objective at the end of each trial (mean over seeds), never by the test split, which "
             "the trials do not evaluate (`train.test_eval=false`). Trials: `runs/<spec>/tuning/`.\n",
             f"![validation objective against lr]({plot})\n",
             "| method | task | settings | trials | failed | trial-steps | wall (s) | chosen lr | weight decay | "
             "objective | on edge | written |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    sections = []
    for c in choices:
        wd = c.trials[c.best][0].get("method.weight_decay")
        failed = [f for f in failures if f"method={c.method}" in f.get("overrides", [])]
        target = f"{c.task}_{c.method}.yaml"
        if tuned_dir is None:
            status = "not asked"
        elif len(pairs[(c.task, c.method)]) > 1:
            status = "no: several settings tuned (one file per task and method)"
        elif c.edges and not accept_edge:
            status = "**no: on the edge**"
        else:
            tuned_dir.mkdir(parents=True, exist_ok=True)
            kept = kept_settings(tuned_dir / target)
            text = tuned_text(c, spec["name"], tuning, command, date, kept)
            if same_setting(tuned_dir / target, text):
                # A rerun (or another spec choosing from the same trials) keeps the file and its provenance:
                # a resumed spec must not dirty the tree its final runs record.
                status = f"`{target}` (unchanged)"
            else:
                (tuned_dir / target).write_text(text)
                written.append(tuned_dir / target)
                status = f"`{target}`"
        others = _shown(c, choices)
        more = f" (+{len(c.earlier)} earlier)" if c.earlier else ""
        lines.append(f"| {c.label} | {c.task} | {others} | {len(c.runs)}{more} | {len(failed)} | {c.steps} "
                     f"| {c.wall:.0f} "
                     f"| {c.best[0]:g} | {wd if wd is not None else '—'} | {c.scale * c.score(c.best):.4g} | "
                     f"{'**YES**' if c.edges else 'no'} | {status} |")
        section = [f"\n## {c.label} on {c.task} ({others})\n",
                   f"Grid: {c.space.describe() if c.space else 'not in this spec'}. Chosen: lr={c.best[0]:g}, "
                   f"weight decay={wd}, {c.objective}={c.scale * c.score(c.best):.4g}. Compute: {len(c.runs)} trials, "
                   f"{c.steps} trial-steps, {c.wall:.1f} s.\n"]
        if c.earlier:
            steps, wall = sum(e["steps"] for e in c.earlier), sum(e["wall_time"] for e in c.earlier)
            lrs = ", ".join(f"{lr:g}" for lr in sorted({e["lr"] for e in c.earlier}))
            section.append(f"Also {len(c.earlier)} trials of earlier grids, budgets or seeds ({steps} trial-steps, "
                           f"{wall:.0f} s; lr {lrs}): not chosen from, but tuning effort this method had beyond "
                           "its grid.\n")
        if c.edges:
            section.append(f"**WARNING: the best point lies on the edge of its grid ({'; '.join(c.edges)}): "
                           "widen the grid in the spec and tune again; not written back"
                           + (" (accepted with --accept-edge)" if accept_edge else "") + ".**\n")
        section += _trial_table(c)
        section += [f"- failed: `{Path(f['run_dir']).name}`: {f['reason']}" for f in failed]
        sections.append("\n".join(section))
    (results_dir / "tuning.md").write_text("\n".join(lines) + "\n" + "\n".join(sections) + "\n")
    for c in choices:
        if c.edges:
            print(f"distlion: WARNING: {c.label} on {c.task}: the best point lies on the edge of its grid "
                  f"({'; '.join(c.edges)}); widen the grid" + ("" if accept_edge else " (not written back)"),
                  flush=True)
    for path in written:
        print(f"distlion: wrote {path}", flush=True)
    return choices
