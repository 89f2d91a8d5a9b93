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
import itertools
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

RANGE_AXES = ("lr", "weight_decay", "lr_x_wd")
_SPEC_KEYS = {"objective", "budget", "seeds", "grid_points_per_decade", "trials", "sweep", "spaces", "write_tuned"}
_TUNED_KEYS = ("method.lr", "method.weight_decay", "seed", "method=", "train.test_eval")

# One grid point: the method settings it sets, lr first, then weight_decay, then the others by name; list values
# (betas) as tuples, so that points are dictionary keys: (("lr", 1e-3), ("weight_decay", 0.1), ("betas", (0.9, 0.99))).
Point = tuple[tuple[str, Any], ...]


class SpecError(ValueError):
    """A tuning section that cannot give every method the same, honest search."""


def yaml_float(value: float) -> str:
    """`value` as YAML reads back a float (3 significant digits): "0.0", not "0", which is an int."""
    text = f"{value:g}"
    return text if any(c in text for c in ".einf") else f"{text}.0"


def _round(value: float) -> float:
    return float(f"{value:.3g}")  # 3 significant digits: readable run directories and tuned files


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


def make_point(settings: dict[str, Any]) -> Point:
    """The point of these method settings in the canonical order (lr, weight_decay, then by name)."""
    order = {"lr": 0, "weight_decay": 1}
    return tuple((k, _hashable(settings[k])) for k in sorted(settings, key=lambda k: (order.get(k, 2), k)))


def show(value: Any) -> str:
    """A setting's value as a Hydra override and in tables: 0.001, [0.9,0.99]."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show(v) for v in value) + "]"
    return yaml_float(value) if isinstance(value, float) else str(value)  # 1.0, not 1: an int in the config


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
class Axis:
    """One searched setting: a method setting (lr, weight_decay, betas, ...) or lr_x_wd (weight decay = value / lr,
    the product Chen et al. tune for Lion). `ordered`: numeric, so a best value at its end asks for a wider grid."""

    name: str
    values: tuple[Any, ...]

    @property
    def ordered(self) -> bool:
        return all(isinstance(v, (int, float)) for v in self.values)

    def describe(self) -> str:
        name = {"weight_decay": "weight decay", "lr_x_wd": "lr x wd"}.get(self.name, self.name)
        return f"{name} {{{', '.join(show(v) for v in self.values)}}}"


@dataclass(frozen=True)
class Space:
    """One method's grid: the product of its axes (lr first)."""

    method: str
    axes: tuple[Axis, ...]

    def axis(self, name: str) -> Axis | None:
        return next((a for a in self.axes if a.name == name), None)

    @property
    def lr(self) -> tuple[float, ...]:
        return self.axes[0].values

    @property
    def names(self) -> tuple[str, ...]:
        """The method settings a point of this grid sets (lr_x_wd sets weight_decay)."""
        return tuple("weight_decay" if a.name == "lr_x_wd" else a.name for a in self.axes)

    def points(self) -> list[Point]:
        points = []
        for values in itertools.product(*(a.values for a in self.axes)):
            settings = dict(zip((a.name for a in self.axes), values))
            if "lr_x_wd" in settings:
                settings["weight_decay"] = _round(settings.pop("lr_x_wd") / settings["lr"])
            points.append(make_point(settings))
        return points

    def contains(self, settings: dict[str, Any]) -> bool:
        """Whether these recorded settings are a point of the grid (floats to 1e-6)."""
        return any(all(_close(settings.get(k), v) for k, v in point) for point in self.points())

    def coordinate(self, point: Point, name: str) -> Any:
        """The point's value on axis `name`; on lr_x_wd the grid's product nearest to lr x wd."""
        settings = dict(point)
        if name != "lr_x_wd":
            return settings.get(name)
        lr, wd = settings["lr"], settings.get("weight_decay") or 0.0
        axis = self.axis("lr_x_wd")
        return min(axis.values, key=lambda p: abs(math.log(p) - math.log(lr * wd)) if wd > 0 else math.inf)

    def edges(self, point: Point) -> list[str]:
        """The ordered axes on whose edge the point lies. An axis of one value is fixed, not searched; a lowest
        value of 0 is no edge (nothing lies below it), and unordered values (betas) have none."""
        found = []
        for axis in self.axes:
            value = self.coordinate(point, axis.name)
            if len(axis.values) < 2 or not axis.ordered:
                continue
            if value == max(axis.values):
                found.append(f"{axis.name}={show(value)} is the highest of its grid")
            elif value == min(axis.values) and value != 0:
                found.append(f"{axis.name}={show(value)} is the lowest of its grid")
        return found

    def describe(self) -> str:
        return " x ".join(a.describe() for a in self.axes)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    return a == b


@dataclass(frozen=True)
class Tuning:
    objective: str  # "validation" (each run's declared objective) or a "val_*" key
    budget: tuple[str, ...]  # overrides of every trial
    seeds: tuple[int, ...]
    per_decade: int
    spaces: tuple[Space, ...]
    sweep: str = ""
    trials: int | None = None
    write_tuned: bool = True  # write the chosen points into conf/tuned/ (false: the spec's final runs alone use them)

    def space(self, method: str) -> Space | None:
        return next((s for s in self.spaces if s.method == method), None)

    def describe_budget(self) -> str:
        return " ".join(self.budget) or "the spec's training length"


def _axis(method: str, name: str, given: Any, per_decade: int) -> Axis:
    """An axis from the spec: [lo, hi] (a log range at the common density) or {values: [...]} (these values)."""
    where = f"tuning.spaces.{method}.{name}"
    if isinstance(given, dict) and set(given) == {"values"} and isinstance(given["values"], list) and given["values"]:
        values = tuple(float(v) if name in RANGE_AXES and isinstance(v, int) else _hashable(v)
                       for v in given["values"])
        if len(set(values)) != len(values):
            raise SpecError(f"{where}: a value is given twice")
        return Axis(name, tuple(sorted(values)) if Axis(name, values).ordered else values)
    if isinstance(given, list) and len(given) == 2:
        try:
            return Axis(name, log_grid(*map(float, given), per_decade))
        except (SpecError, TypeError, ValueError) as err:
            raise SpecError(f"{where}: {err}") from None
    raise SpecError(f"{where}: give a log range [lo, hi] or a list of values {{values: [...]}}")


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
        shared = [k for k in ranges if k in _SPEC_KEYS or "." in k or k == "budget"]
        if shared:  # a per-method budget or density would make the comparison unfair
            raise SpecError(f"tuning.spaces.{method}.{shared[0]}: a method's space holds only method settings "
                            "(lr, weight_decay or lr_x_wd, betas, ...); the budget, density and seeds are the same "
                            "for every method (tuning.budget, tuning.grid_points_per_decade, tuning.seeds)")
        if "lr" not in ranges:
            raise SpecError(f"tuning.spaces.{method}: give an lr range [lo, hi]")
        if "weight_decay" in ranges and "lr_x_wd" in ranges:
            raise SpecError(f"tuning.spaces.{method}: search weight_decay or lr_x_wd, not both")
        names = ["lr", *(k for k in ("weight_decay", "lr_x_wd") if k in ranges),
                 *sorted(k for k in ranges if k not in RANGE_AXES)]
        spaces.append(Space(method, tuple(_axis(method, name, ranges[name], per_decade) for name in names)))
    if not spaces:
        raise SpecError("tuning.spaces: give at least one method's space")
    trials = section.get("trials")
    if trials is not None:
        uneven = {s.method: len(s.points()) for s in spaces if len(s.points()) != trials}
        if uneven:
            raise SpecError(f"tuning.trials={trials}, but these methods' grids have other sizes: {uneven}; "
                            "give every method the same number of trials")
    seeds = tuple(int(s) for s in section.get("seeds", [0]))
    return Tuning(objective, budget, seeds, per_decade, tuple(spaces), str(section.get("sweep", "")), trials,
                  bool(section.get("write_tuned", True)))


def check_fresh_seeds(spec: dict[str, Any], tuning: Tuning) -> None:
    """Refuse trial seeds that are also final seeds: the final run at the chosen point would be the chosen trial
    itself, and the selection's luck would enter the reported mean."""
    shared = sorted(set(tuning.seeds) & {int(s) for s in spec.get("seeds", [0])})
    if shared:
        raise SpecError(f"tuning.seeds and the final seeds share {shared}: a final run would repeat the trial it "
                        "was chosen by; tune at other seeds (e.g. tuning.seeds: [100, 101])")


def trial_sweeps(tuning: Tuning) -> list[str]:
    """The grid as Hydra basic-sweeper overrides: one sweep per method, or per (method, lr) for lr x wd,
    whose weight decays depend on the lr (a sweep is a Cartesian product)."""
    sweeps = []
    for space in tuning.spaces:
        head = f"method={space.method} {tuning.sweep}".strip()
        others = " ".join(f"method.{a.name}=" + ",".join(show(v) for v in a.values)
                          for a in space.axes if a.name not in RANGE_AXES)
        if space.axis("lr_x_wd") is not None:
            for lr in space.lr:
                decays = sorted({dict(p)["weight_decay"] for p in space.points() if dict(p)["lr"] == lr})
                sweeps.append(f"{head} method.lr={lr:g} method.weight_decay={','.join(map(show, decays))} {others}"
                              .strip())
        else:
            wd = space.axis("weight_decay")
            wd = f" method.weight_decay={','.join(map(show, wd.values))}" if wd else ""
            sweeps.append(f"{head} method.lr={','.join(map(show, space.lr))}{wd} {others}".strip())
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
    best: Point = ()
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


def _objective(summary: dict[str, Any], objective: str) -> tuple[str, bool, float]:
    key = summary.get("objective") if objective == "validation" else objective
    metric = next((m for m in summary.get("metrics", []) if m["key"] == key), None)
    if metric is None or metric["split"] != "validation":
        raise SpecError(f"{summary.get('run_dir')}: no validation metric {key!r} to select by")
    return key, metric["higher_is_better"], metric.get("scale", 1.0)


def trial_point(summary: dict[str, Any], space: Space | None) -> Point:
    """The grid point a finished trial ran at: its lr, weight decay and the space's other axes."""
    settings = {"lr": summary["lr"], "weight_decay": summary.get("method.weight_decay")}
    for name in space.names if space is not None else ():
        if name not in settings:
            settings[name] = summary.get(f"method.{name}")
    return make_point(settings)


def is_current(summary: dict[str, Any], tuning: Tuning, space: Space | None) -> bool:
    """Whether a finished trial belongs to the tuning as the spec is now: one of its seeds, a point of its grid
    and its budget (a runs folder keeps the trials of earlier grids and budgets, which must not be chosen)."""
    if summary.get("seed") not in tuning.seeds:
        return False
    if space is not None:
        settings = dict(trial_point(summary, space))
        settings["weight_decay"] = settings["weight_decay"] or 0.0
        if not space.contains(settings):
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
        space = tuning.space(info.name)
        searched = {f"method.{name}" for name in (space.names if space else ())} | {"method.weight_decay"}
        others = tuple(sorted((k, _hashable(v)) for k, v in s.items()
                              if k in ("workers", "per_worker_batch") or
                              (k.startswith("method.") and k not in searched)))
        key = (s["task"], info.name, others)
        if not is_current(s, tuning, space):
            earlier[key].append(s)
            continue
        if key not in choices:
            objective, higher, scale = _objective(s, tuning.objective)
            choices[key] = Choice(s["task"], info.name, info.label, others, objective, higher, scale,
                                  tuning.space(info.name))
        choices[key].trials.setdefault(trial_point(s, space), []).append(s)
    for key, c in choices.items():
        c.earlier = earlier.get(key, [])
        sign = 1.0 if c.higher_is_better else -1.0

        def rank(point: Point, c: Choice = c, sign: float = sign) -> tuple:
            score = c.score(point)
            return (math.isnan(score), -sign * score if not math.isnan(score) else 0.0, _order(point))

        c.best = min(c.trials, key=rank)
        c.edges = c.space.edges(c.best) if c.space is not None else []
    return sorted(choices.values(), key=lambda c: (c.task, label_order(c.label), c.label, c.others))


def _order(point: Point) -> tuple:
    """Ties go to the smaller lr, then the smaller weight decay, then the other settings in their order."""
    return tuple((v or 0.0) if isinstance(v, (int, float)) or v is None else show(v) for _, v in point)


def load_trials(root: Path) -> list[dict[str, Any]]:
    """The finished trials' summaries under `root`."""
    trials = []
    for path in sorted(root.rglob("summary.json")):
        summary = json.loads(path.read_text())
        summary["run_dir"] = str(path.parent)
        trials.append(summary)
    return trials


def kept_settings(path: Path, tuned: tuple[str, ...] = ("lr", "weight_decay")) -> dict[str, Any]:
    """The method settings of an existing tuned file other than the `tuned` ones (e.g. betas): the trials ran
    with them, so the rewritten file keeps them."""
    if not path.is_file():
        return {}
    method = (yaml.safe_load(path.read_text()) or {}).get("method") or {}
    return {k: v for k, v in method.items() if k not in tuned}


def same_setting(path: Path, text: str) -> bool:
    """Whether the tuned file at `path` already holds the method settings of `text` (comments aside)."""
    if not path.is_file():
        return False
    return (yaml.safe_load(path.read_text()) or {}).get("method") == yaml.safe_load(text).get("method")


def chosen_settings(c: Choice) -> dict[str, Any]:
    """The method settings of the chosen point, with the weight decay the trials ran with when it was not searched."""
    settings = dict(c.best)
    if settings.get("weight_decay") is None:
        settings["weight_decay"] = c.trials[c.best][0].get("method.weight_decay")
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items() if v is not None}


def _yaml_value(value: Any) -> str:
    return yaml_float(value) if isinstance(value, float) else json.dumps(value)  # JSON values are YAML


def tuned_text(c: Choice, spec_name: str, tuning: Tuning, command: str, date: str,
               kept: dict[str, Any] | None = None) -> str:
    """A conf/tuned file for the choice, its provenance in comments; `kept`: other method settings it keeps."""
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
    lines.append("method:")
    lines += [f"  {key}: {_yaml_value(value)}" for key, value in chosen_settings(c).items()]
    if kept:
        lines.append("  # kept from the file the trials ran with (not tuned here):")
        lines += [f"  {key}: {json.dumps(value)}" for key, value in kept.items()]
    return "\n".join(lines) + "\n"


def _beside_lr(c: Choice, point: Point) -> tuple[tuple[str, Any], ...]:
    """The point's coordinates other than lr: one line of the plot, one group of the table."""
    names = [a.name for a in c.space.axes[1:]] if c.space else ["weight_decay"]
    return tuple((name, c.space.coordinate(point, name) if c.space else dict(point).get(name)) for name in names)


def _describe(coordinates: tuple[tuple[str, Any], ...]) -> str:
    short = {"weight_decay": "wd", "lr_x_wd": "lr x wd"}
    return "".join(f", {short.get(k, k)}={show(v)}" for k, v in coordinates if v is not None)


def _plot(choices: list[Choice], path: Path) -> None:
    """The validation objective against lr, log x: one line per method and setting of the other axes, chosen
    point starred."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cmap = plt.get_cmap("tab10")
    styles = ("-", "--", ":", "-.")
    for i, c in enumerate(choices):
        lines: dict[Any, list[Point]] = defaultdict(list)
        for point in c.trials:
            lines[_beside_lr(c, point)].append(point)
        for j, (beside, points) in enumerate(sorted(lines.items(), key=lambda kv: _order(kv[1][0])[1:])):
            points.sort(key=_order)
            ax.plot([dict(p)["lr"] for p in points], [c.scale * c.score(p) for p in points], marker="o",
                    markersize=4, color=cmap(i % 10), ls=styles[j % len(styles)], label=f"{c.label}{_describe(beside)}")
        ax.plot(dict(c.best)["lr"], c.scale * c.score(c.best), marker="*", markersize=14, color=cmap(i % 10),
                markeredgecolor="black", ls="none")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    metric = choices[0].objective
    ax.set_ylabel(f"{metric} at the end of the trial" + (" (%)" if choices[0].scale == 100 else ""))
    ax.set_title("tuning: validation objective against lr (star: chosen)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7 if sum(len(c.trials) for c in choices) < 60 else 5, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _trial_table(c: Choice) -> list[str]:
    extra = [a.name for a in c.space.axes if a.name not in ("lr", "weight_decay")] if c.space else []
    names = {"lr_x_wd": "lr x wd"}
    header = ["lr", "weight decay", *(names.get(n, n) for n in extra), c.objective, "seeds", "steps", "wall (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for point in sorted(c.trials, key=_order):
        runs, settings = c.trials[point], dict(point)
        cells = [show(settings["lr"]), "—" if settings.get("weight_decay") is None else show(settings["weight_decay"]),
                 *(show(c.space.coordinate(point, n)) for n in extra),
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
             "the trials do not evaluate (`train.test_eval=false`). Trials: `runs/<spec>/tuning/`, every one recorded "
             "in `records/tuning.jsonl.gz` (earlier grids' too: the counts below).\n",
             f"![validation objective against lr]({plot})\n",
             "| method | task | settings | trials | failed | trial-steps | wall (s) | chosen | "
             "objective | on edge | written |", "|---|---|---|---:|---:|---:|---:|---|---:|---|---|"]
    sections = []
    for c in choices:
        chosen = ", ".join(f"{k}={show(v)}" for k, v in chosen_settings(c).items())
        failed = [f for f in failures if f"method={c.method}" in f.get("overrides", [])]
        target = f"{c.task}_{c.method}.yaml"
        if tuned_dir is None or not tuning.write_tuned:
            status = "not asked" if tuned_dir is None else "no: tuning.write_tuned=false (the spec's runs alone)"
        elif len(pairs[(c.task, c.method)]) > 1:
            status = "no: several settings tuned (one file per task and method)"
        elif c.edges and not accept_edge:
            status = "**no: on the edge**"
        else:
            tuned_dir.mkdir(parents=True, exist_ok=True)
            kept = kept_settings(tuned_dir / target, ("lr", "weight_decay", *(c.space.names if c.space else ())))
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
                     f"| {chosen} | {c.scale * c.score(c.best):.4g} | "
                     f"{'**YES**' if c.edges else 'no'} | {status} |")
        section = [f"\n## {c.label} on {c.task} ({others})\n",
                   f"Grid: {c.space.describe() if c.space else 'not in this spec'}. Chosen: {chosen}, "
                   f"{c.objective}={c.scale * c.score(c.best):.4g}. Compute: {len(c.runs)} trials, "
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



def suggest(trial: Any, space: Space) -> dict[str, Any]:
    """The method settings an optuna trial draws from `space`: lr (and a range of lr x wd) log-uniform over the
    grid's range, rounded to 3 significant digits as grid points are; listed values as categories (by index: optuna's
    categories are scalars, betas are lists)."""
    settings: dict[str, Any] = {}
    for axis in space.axes:
        if axis.name in ("lr", "lr_x_wd") and len(axis.values) > 1 and axis.ordered and min(axis.values) > 0:
            value = _round(trial.suggest_float(axis.name, min(axis.values), max(axis.values), log=True))
        elif len(axis.values) == 1:
            value = axis.values[0]
        else:
            value = axis.values[trial.suggest_categorical(axis.name, list(range(len(axis.values))))]
        settings[axis.name] = value
    if "lr_x_wd" in settings:
        settings["weight_decay"] = _round(settings.pop("lr_x_wd") / settings["lr"])
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
