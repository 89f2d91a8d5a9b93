"""Run an experiment spec: `distlion-experiment experiments/demo.yaml` (or `make experiment NAME=demo`).

A spec (see `experiments/`) names its grid as Hydra multirun sweeps and the seeds. Each sweep runs as
one `python -m distlion.train -m ...` into `runs/<name>/`, where every grid point has a fixed directory;
rerunning the same command skips finished runs and resumes killed ones. Then the report (tables, CSVs,
plots) is written into `results/<name>/` with the command that made it.

A spec with a `tuning:` section (see `distlion.tuning`) tunes first with `--tune` (or only tunes, with
`--tune-only`): its trials run into `runs/<name>/tuning/`, the chosen settings are written into
`conf/tuned/`, and its sweeps, the final runs, then run into `runs/<name>/final/` with them.

A spec with a `pretrain:` section (a list of overrides: one run) runs it first into `runs/<name>/pretrain/`,
saving its model (`train.save_model=true`); every tuning trial and final run then starts from that model
(`model=llama_pretrained model.pretrained=<its folder>`): a finetune.

`--estimate` trains nothing: it prints runs x steps x seconds per step = device-hours for the runs' device
(`train.device`), steps from the runner's own `build_run`, seconds timed on one worker's batch (`distlion.estimate`).

A failing grid point does not stop the others: it is recorded with its reason, the report is built
from the finished runs and lists it, and the command exits 1. A second copy of a running spec skips
the points the first one holds. Each sweep runs in its own process group under a small group leader
that ends the whole group, joblib workers included, when the driver dies, even by SIGKILL.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from distlion.cli import read_failures
from distlion.methods import method_info
from distlion.pages import render_index
from distlion.records import INDEX, pack, pack_spec, unpack
from distlion.report import Target, derive_target, load_runs, write_report, write_task_target
from distlion.runio import HASH_DIR
from distlion.tuning import (
    Choice,
    SpecError,
    check_fresh_seeds,
    chosen_settings,
    parse_tuning,
    show,
    trial_spec,
    write_tuning,
)
from distlion.wallclock import write as write_wallclock
from distlion.wallclock import write_modelled

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"


def load_spec(name_or_path: str) -> tuple[Path, dict]:
    path = Path(name_or_path)
    if not path.exists():
        path = REPO / "experiments" / f"{name_or_path}.yaml"
    if not path.exists():
        available = sorted(p.stem for p in (REPO / "experiments").glob("*.yaml"))
        raise SystemExit(f"distlion: error: no experiment spec {name_or_path!r}; choose one of {available}")
    return path, OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def sweep_commands(spec: dict, extra: list[str], runs_dir: Path) -> list[list[str]]:
    """One Hydra multirun command per sweep of the spec, writing its runs under `runs_dir`."""
    seeds = ",".join(str(s) for s in spec.get("seeds", [0]))
    commands = []
    for sweep in spec["sweeps"]:
        commands.append([sys.executable, "-m", "distlion.train", "-m", f"experiment={spec['name']}",
                         *spec.get("base", []), *shlex.split(sweep), f"seed={seeds}", *extra,
                         f"hydra.sweep.dir={runs_dir}"])
    return commands


def unfinished(commands: list[list[str]], conf_dir: Path) -> list[list[str]]:
    """The sweep commands with a point still to run: a sweep whose every point has a finished run of its config
    (in its folder `<sweep dir>/<config hash>/`) is left out, so a rerun of a finished spec launches nothing, and a
    sweep with fewer points left than its joblib `n_jobs` asks for only as many (the rest go to the next sweeps; see
    `_run_sweeps`). A point whose config does not compose here is launched, to fail there with its own message.
    Writes each sweep folder's index: the spec's points and their config hashes (`write_index`)."""
    from hydra import compose, initialize_config_dir

    from distlion.runio import config_hash, read_summary

    pending, skipped_runs, index = [], 0, {}
    with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base="1.3"):
        for command in commands:
            overrides = command[command.index("-m", 3) + 1:]
            sweep_dir = Path(next(o for o in overrides if o.startswith("hydra.sweep.dir=")).split("=", 1)[1])
            try:
                points = sweep_points(shlex.join(o for o in overrides if not o.startswith("hydra")))
                hashes = {shlex.join(p): config_hash(compose("config", overrides=p)) for p in points}
            except Exception:  # noqa: BLE001 - the run itself reports what is wrong with it
                points, hashes = [[]], {}
            index.setdefault(sweep_dir, {}).update(hashes)
            left = len(points) - sum(read_summary(sweep_dir / h) is not None for h in hashes.values())
            if left:
                n_jobs = launcher_jobs(command)
                pending.append(command if n_jobs is None else with_n_jobs(command, min(n_jobs, left)))
            else:
                skipped_runs += len(points)
    for sweep_dir, hashes in index.items():
        write_index(sweep_dir, hashes)
    if len(pending) < len(commands):
        print(f"distlion: {len(commands) - len(pending)} of {len(commands)} sweeps ({skipped_runs} runs) are finished "
              f"in {sweep_dir.parent.name}/{sweep_dir.name}; not launched", file=sys.stderr)
    return pending


def write_index(sweep_dir: Path, hashes: dict[str, str]) -> None:
    """`<sweep dir>/index.json`: each point of the spec as it is now (its overrides) and the config hash that names
    its run folder. The report reads the runs it lists; the folder may hold others (earlier grids, other seeds)."""
    from distlion.runio import atomic_write_text

    sweep_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(sweep_dir / INDEX, json.dumps({"version": 1, "points": hashes}, indent=1) + "\n")


def sweep_points(sweep: str) -> list[list[str]]:
    """The single-run overrides of a sweep ("method=a,b cluster.workers=4,8": 4 points), by Hydra's own parser."""
    overrides = OverridesParser.create().parse_overrides(shlex.split(sweep))
    choices = [[f"{o.get_key_element()}={v}" for v in (o.sweep_string_iterator() if o.is_sweep_override()
                                                      else [o.get_value_element_as_str()])] for o in overrides]
    return [list(point) for point in itertools.product(*choices)]


def _setting(overrides: list[str], key: str) -> Any:
    """The last value `overrides` give `key` (Hydra's rule: a later override wins), parsed as YAML; None if none."""
    values = [yaml.safe_load(o.split("=", 1)[1]) for o in overrides if o.split("=", 1)[0] == key]
    return values[-1] if values else None


def final_sweeps(spec: dict[str, Any], choices: list[Choice]) -> list[str]:
    """The spec's sweeps with each point's chosen settings as explicit overrides: the choice of its own method,
    workers and batch, else the one choice of its method (tuned at another setting, as the spec says). So the final
    runs need no conf/tuned file, and a spec tuning several worker counts or batches runs each with its own."""
    sweeps = []
    base = list(spec.get("base", []))
    for sweep in spec["sweeps"]:
        for point in sweep_points(sweep):
            overrides = [*base, *point]
            method = _setting(overrides, "method")
            own = [c for c in choices if c.method == method]
            setting = {"workers": _setting(overrides, "cluster.workers"),
                       "per_worker_batch": _setting(overrides, "cluster.per_worker_batch")}
            exact = [c for c in own if all(v is None or dict(c.others).get(k) == v for k, v in setting.items())]
            points = {c.best for c in (exact or own)}
            if len(points) > 1:
                raise SpecError(f"{' '.join(point)}: {len(points)} tuned settings of {method} fit this point "
                                f"({[dict(p) for p in points]}); tune at its workers and batch or drop the others")
            chosen = chosen_settings((exact or own)[0]) if points else {}
            sweeps.append(shlex.join([*point, *(f"method.{k}={show(v)}" for k, v in chosen.items())]))
    return sweeps


def optuna_search(spec: dict, tuning: Any, space: Any, sampler_seed: int, n_trials: int, extra: list[str],
                  trials_dir: Path, conf_dir: Path) -> list[float]:
    """`n_trials` points of `space` drawn by optuna's TPE sampler (seeded), each run at the tuning's seeds like a
    grid point (same budget, same folder: a point both searches draw runs once) and scored by the mean validation
    objective over them; the objectives in trial order (nan: a trial that failed). Rerunning it draws the same
    points, so finished trials are skipped."""
    import optuna

    from distlion.tuning import _close, _objective, load_trials, make_point, suggest, trial_point

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=sampler_seed))  # minimizes sign x objective
    objectives = []
    for _ in range(n_trials):
        trial = study.ask()
        settings = suggest(trial, space)
        sweep = shlex.join([f"method={space.method}", *shlex.split(tuning.sweep),
                            *(f"method.{k}={show(v)}" for k, v in settings.items())])
        commands = sweep_commands({**trial_spec(spec, tuning), "sweeps": [sweep]}, extra, trials_dir)
        _run_sweeps([with_config_dir(c, conf_dir) for c in unfinished(commands, conf_dir)])
        wanted = make_point(settings)
        runs = [r for r in load_trials(trials_dir) if r.get("seed") in tuning.seeds
                and all(_close(v, dict(trial_point(r, space)).get(k)) for k, v in wanted)]
        if len(runs) < len(tuning.seeds):
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            objectives.append(math.nan)
            continue
        key, higher, _ = _objective(runs[0], tuning.objective)
        value = statistics.mean(r[key] for r in runs[:len(tuning.seeds)])
        study.tell(trial, -value if higher else value)
        objectives.append(value)
    return objectives


def compare_samplers(spec: dict, tuning: Any, extra: list[str], base_dir: Path, results_dir: Path, conf_dir: Path,
                     sampler_seeds: tuple[int, ...] = (0, 1, 2)) -> str:
    """The grid against optuna's TPE at the same trial budget per method (the grid's number of points), TPE over
    `sampler_seeds`: the best validation objective each reached, into `samplers.md`. The grid's trials are the
    spec's tuning trials (run them first: --tune-only)."""
    from distlion.tuning import load_trials, select

    choices = select(load_trials(base_dir / "tuning"), tuning)
    lines = ["# Grid against optuna (TPE) at the same trial budget\n",
             f"Each method: the grid's points, and as many TPE trials (seeds {list(sampler_seeds)} of the sampler), "
             f"each trial at the tuning seeds {list(tuning.seeds)} with the same budget; the best mean validation "
             "objective each reached. TPE's trials: `runs/<spec>/tuning_optuna/` (a point both draw runs once).\n",
             "| method | trials | grid best | " + " | ".join(f"TPE seed {s}" for s in sampler_seeds)
             + " | TPE mean | better |", "|---|---:|---:|" + "---:|" * len(sampler_seeds) + "---:|---|"]
    for space in tuning.spaces:
        choice = next((c for c in choices if c.method == space.method), None)
        if choice is None:
            continue
        n = len(space.points())
        higher = choice.higher_is_better
        bests = []
        for seed in sampler_seeds:
            found = [v for v in optuna_search(spec, tuning, space, seed, n, extra, base_dir / "tuning_optuna",
                                              conf_dir) if not math.isnan(v)]
            bests.append((max if higher else min)(found) if found else math.nan)
        grid, tpe = choice.score(choice.best), statistics.mean(bests)
        better = "grid" if (grid >= tpe if higher else grid <= tpe) else "TPE"
        scale = choice.scale
        lines.append(f"| {choice.label} | {n} | {scale * grid:.4g} | " + " | ".join(f"{scale * b:.4g}" for b in bests)
                     + f" | {scale * tpe:.4g} | {better} |")
    text = "\n".join(lines) + "\n"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "samplers.md").write_text(text)
    return text


def pretrain_command(spec: dict, extra: list[str], run_dir: Path) -> list[str]:
    """The spec's `pretrain:` run, which saves its model into `run_dir`/model."""
    return [sys.executable, "-m", "distlion.train", f"experiment={spec['name']}", *spec["pretrain"], *extra,
            "train.save_model=true", f"hydra.run.dir='{run_dir}'"]


def finetuning(spec: dict, model_dir: Path) -> dict:
    """The spec with every run starting from the pretrained model in `model_dir`."""
    return {**spec, "base": [*spec.get("base", []), "model=llama_pretrained", f"model.pretrained='{model_dir}'"]}


def netem_commands(spec: dict, extra: list[str], runs_dir: Path) -> list[list[str]]:
    """One command per point, seed and link of a spec with a `netem: {ranks, rates}` section: torchrun with
    `ranks` ranks under distlion-netem, each rank on its own link of the rate, into runs_dir/<its config hash>.
    `rates` is a list, or a mapping from each rate to overrides of its runs (e.g. a shorter train.steps).
    Timed runs: one at a time, so that they do not share the machine."""
    ranks, rates = int(spec["netem"]["ranks"]), spec["netem"]["rates"]
    rates = {str(r): list(extra or []) for r, extra in rates.items()} if isinstance(rates, dict) else \
        {str(r): [] for r in rates}
    commands = []
    for sweep in spec["sweeps"]:
        for point in sweep_points(sweep):
            for seed in spec.get("seeds", [0]):
                for rate, per_rate in rates.items():
                    overrides = [*spec.get("base", []), *point, *per_rate, f"seed={seed}", f"cluster.link={rate}"]
                    commands.append([
                        sys.executable, "-m", "distlion.netem", "--ranks", str(ranks), "--rate", rate, "--",
                        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                        "-m", "distlion.train", f"experiment={spec['name']}", *overrides, *extra,
                        f"hydra.run.dir='{runs_dir / HASH_DIR}'"])
    return commands


# The group leader of one sweep (`python -c`, so that it starts in an instant): it runs the Hydra child in
# the new process group it leads and kills the whole group when the driver dies (the kernel sends it
# PR_SET_PDEATHSIG's signal, even when the driver was killed by SIGKILL) or when it gets SIGTERM.
_GROUP_LEADER = """
import ctypes, os, signal, subprocess, sys
def end_group(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, end_group)
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    end_group()  # the driver died before prctl
code = subprocess.call(sys.argv[2:])
sys.exit(code if code >= 0 else 128 - code)
"""


def with_config_dir(command: list[str], conf_dir: Path) -> list[str]:
    """The command reading its configs from `conf_dir` (a copy of conf/) instead of conf/. Hydra's --config-path:
    its --config-dir is searched after conf/, whose tuned files would then win."""
    if conf_dir.resolve() == CONF:
        return command
    return [*command[:3], "--config-path", str(conf_dir.resolve()), *command[3:]]


def start_sweep(command: list[str]) -> subprocess.Popen:
    """Start one sweep's command in its own process group. The group ends with the driver: on Ctrl-C, SIGTERM (see
    `main`) or an error here through `end_sweep`, on SIGKILL through the group leader."""
    print("+", shlex.join(command[1:]), flush=True)
    return subprocess.Popen([sys.executable, "-c", _GROUP_LEADER, str(os.getpid()), *command], cwd=REPO,
                            start_new_session=True)


def end_sweep(leader: subprocess.Popen) -> None:
    with suppress(ProcessLookupError):
        os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()


def launcher_jobs(command: list[str]) -> int | None:
    """The sweep's joblib `n_jobs` (the last one given); None without that launcher."""
    n_jobs = [int(o.split("=", 1)[1]) for o in command if o.startswith("hydra.launcher.n_jobs=")]
    return n_jobs[-1] if n_jobs else None


def sweep_slots(command: list[str]) -> int | None:
    """How many of the sweep's points run at once: its joblib `n_jobs`, at most its number of points; None for a
    sweep without that launcher (it runs alone)."""
    n_jobs = launcher_jobs(command)
    if n_jobs is None:
        return None
    overrides = command[command.index("-m", 3) + 1:]
    return max(1, min(n_jobs, len(sweep_points(shlex.join(o for o in overrides if not o.startswith("hydra"))))))


def with_n_jobs(command: list[str], n_jobs: int) -> list[str]:
    return [f"hydra.launcher.n_jobs={n_jobs}" if o.startswith("hydra.launcher.n_jobs=") else o for o in command]


@contextmanager
def report_lock(runs_dir: Path) -> Iterator[None]:
    """One report writer at a time: a second copy of the spec waits, then writes its own."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    with (runs_dir / ".report.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def spec_target(spec: dict[str, Any], runs_dir: Path, conf_dir: Path | None) -> Target:
    """The target a spec's `report.target_from` ({method, at, where}) derives from its finished runs; with
    `conf_dir`, also written into that config folder's task file with its provenance."""
    setting = dict(spec["report"]["target_from"])
    unknown = set(setting) - {"method", "at", "where"}
    if unknown or "method" not in setting:
        raise ValueError(f"report.target_from takes method, at and where; got {sorted(setting)}")
    task, target = derive_target(load_runs(runs_dir), method_info(setting["method"]).label,
                                 float(setting.get("at", 0.75)), setting.get("where"), spec["name"])
    if conf_dir is not None:
        path = conf_dir / "task" / f"{task}.yaml"
        write_task_target(path, target)
        print(f"distlion: wrote the target {target.metric} = {target.value:.6g} into {path}", flush=True)
    return target


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through _run_sweeps, which ends the sweeps' groups


def _run_sweeps(commands: list[list[str]]) -> int:
    """Run the sweeps in order; how many ended with an error. A sweep of fewer points than its `n_jobs` (a D-Lion
    lr x weight-decay pair is one point) leaves the rest of the jobs to the sweeps after it, so `--jobs` points run
    at once; a sweep without the joblib launcher runs alone. Ctrl-C or SIGTERM ends the running ones."""
    slots = [sweep_slots(c) for c in commands]
    budget = max((s for s in slots if s is not None), default=1)
    failed, queue, running = 0, list(zip(commands, slots)), {}
    try:
        while queue or running:
            while queue and (not running or (queue[0][1] is not None and None not in running.values()
                                              and sum(running.values()) + queue[0][1] <= budget)):
                command, n = queue.pop(0)
                running[start_sweep(command if n is None else with_n_jobs(command, n))] = n
            done = [leader for leader in running if leader.poll() is not None]
            for leader in done:
                failed += leader.returncode != 0
                del running[leader]
            if not done:
                time.sleep(0.5)
    except KeyboardInterrupt:
        for leader in running:
            end_sweep(leader)
        print("distlion: stopped; rerun the same command to go on: finished runs are skipped", file=sys.stderr)
        sys.exit(130)
    except BaseException:
        for leader in running:
            end_sweep(leader)
        raise
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description="Run an experiment spec, then write its tables and plots.")
    parser.add_argument("spec", help="a spec name in experiments/ or a path to one")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. logger=none)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the report from finished runs")
    parser.add_argument("--jobs", type=int, default=1,
                        help="grid points run at once (Hydra's joblib launcher); each run uses train.threads")
    parser.add_argument("--out", type=Path, default=REPO,
                        help="base folder of runs/<name>/ and results/<name>/ (default: the repository)")
    parser.add_argument("--tune", action="store_true",
                        help="run the spec's tuning first, write the chosen settings into conf/tuned/, then the runs")
    parser.add_argument("--tune-only", action="store_true", help="only the tuning: trials, tuning.md, conf/tuned/")
    parser.add_argument("--accept-edge", action="store_true",
                        help="write back a chosen point on the edge of its grid (else: widen the grid)")
    parser.add_argument("--set-target", action="store_true",
                        help="write the target that report.target_from derives into conf/task/<task>.yaml")
    parser.add_argument("--conf-dir", type=Path, default=CONF,
                        help="config folder of every run, whose tuned/ the tuning writes (default: conf/; another "
                             "folder starts as a copy of conf/)")
    parser.add_argument("--strict", action="store_true",
                        help="refuse a report of dirty runs or of commits whose method or task code differs")
    parser.add_argument("--no-records", action="store_true",
                        help="train what runs/<name>/ lacks even where results/<name>/records/ holds it (a demo "
                             "that shows the training; the records keep their first copy)")
    parser.add_argument("--compare-samplers", action="store_true",
                        help="after the tuning's grid trials: optuna's TPE at the same trial budget over 3 sampler "
                             "seeds, the best objective each reached into results/<name>/samplers.md")
    parser.add_argument("--estimate", action="store_true",
                        help="train nothing: print runs x steps x seconds per step = device-hours on the runs' "
                             "train.device (distlion/estimate.py)")
    parser.add_argument("--memory", type=float, default=None, metavar="GIB",
                        help="with --estimate: memory a timed model may take (default: the device's free memory); "
                             "a model that needs more is timed at a reduced depth")
    args = parser.parse_intermixed_args()  # overrides may follow the options
    path, spec = load_spec(args.spec)
    try:
        tuning = parse_tuning(spec) if "tuning" in spec or args.tune or args.tune_only else None
    except SpecError as err:
        raise SystemExit(f"distlion: error: {path.name}: {err}") from None
    base_dir, results_dir = args.out.resolve() / "runs" / spec["name"], args.out.resolve() / "results" / spec["name"]
    if args.estimate:  # before anything is written or run
        from distlion.estimate import main_estimate

        sys.exit(main_estimate(spec, tuning, args.overrides, args.conf_dir, base_dir, args.memory))
    # The recorded runs of results/<spec>/records/ (another machine's, a clean clone's) count as finished here.
    restored = 0 if args.no_records else unpack(results_dir / "records", base_dir)
    if restored:
        print(f"distlion: {restored} finished runs restored from {results_dir / 'records'}", file=sys.stderr)
    # With a tuning or a pretraining the final runs sit beside them in final/, and the report reads those.
    runs_dir = base_dir / "final" if tuning is not None or "pretrain" in spec else base_dir
    trials_dir = base_dir / "tuning"
    shown = shlex.join(["distlion-experiment", str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
                        *args.overrides, *(["--jobs", str(args.jobs)] if args.jobs > 1 else [])])
    # --jobs: points at once through joblib; a launcher of the user's (hydra/launcher=submitit_slurm) decides itself.
    own_launcher = any(o.startswith("hydra/launcher=") for o in args.overrides)
    launcher = [] if args.jobs <= 1 or own_launcher else ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.jobs}"]
    failed_sweeps = 0
    if not args.report_only:
        signal.signal(signal.SIGTERM, _stop)
        if args.conf_dir.resolve() != CONF and not (args.conf_dir / "config.yaml").exists():
            shutil.copytree(CONF, args.conf_dir, dirs_exist_ok=True)  # a copy whose tuned/ the tuning rewrites
    if "pretrain" in spec:
        pretrain_dir = base_dir / "pretrain"
        if not args.report_only:
            command = with_config_dir(pretrain_command(spec, args.overrides, pretrain_dir), args.conf_dir)
            if _run_sweeps([command]):
                raise SystemExit(f"distlion: error: the pretraining run failed; see {pretrain_dir}; fix it and rerun "
                                 "the same command (a finished pretraining is skipped)")
        spec = finetuning(spec, pretrain_dir / "model")
    # The tuning's report (tuning.md, the tuned files) is written by the tuning alone: --report-only leaves it.
    if tuning is not None and (args.tune or args.tune_only):
        try:
            check_fresh_seeds(spec, tuning)
        except SpecError as err:
            raise SystemExit(f"distlion: error: {path.name}: {err}") from None
        commands = unfinished(sweep_commands(trial_spec(spec, tuning), args.overrides + launcher, trials_dir),
                              args.conf_dir)
        _run_sweeps([with_config_dir(c, args.conf_dir) for c in commands])  # failed trials are listed
        pack(trials_dir, results_dir / "records", "tuning")
        flags = ["--tune-only" if args.tune_only else "--tune", *(["--accept-edge"] if args.accept_edge else [])]
        try:
            with report_lock(base_dir):
                choices = write_tuning(spec, tuning, trials_dir, results_dir, f"{shown} {shlex.join(flags)}",
                                       args.conf_dir / "tuned", args.accept_edge)
            print(f"tuning reported in {results_dir / 'tuning.md'}")
            on_edge = [c.label for c in choices if c.edges]
            if args.tune and on_edge and not args.accept_edge:  # the final runs would use stale settings
                print(f"distlion: error: {', '.join(on_edge)}: best point on the edge of the grid; widen the grid "
                      "in the spec and rerun (finished trials are skipped), or pass --accept-edge; no final runs",
                      file=sys.stderr)
                sys.exit(1)
        except (FileNotFoundError, SpecError) as err:
            print(f"distlion: error: {err}", file=sys.stderr)
            sys.exit(1)
        if args.compare_samplers:
            print(compare_samplers(spec, tuning, args.overrides + launcher, base_dir, results_dir, args.conf_dir))
        if args.tune_only:
            return
        spec = {**spec, "sweeps": final_sweeps(spec, choices)}  # each point at its own chosen settings
    if not args.report_only and "netem" in spec:
        if args.jobs > 1:
            raise SystemExit(f"distlion: error: {path.name} times its runs on emulated links: run it with --jobs 1, "
                             "alone on the machine")
        failed_sweeps += _run_sweeps(netem_commands(spec, args.overrides, runs_dir))
    elif not args.report_only:
        commands = unfinished(sweep_commands(spec, args.overrides + launcher, runs_dir), args.conf_dir)
        failed_sweeps += _run_sweeps([with_config_dir(c, args.conf_dir) for c in commands])
    if not args.report_only:  # what finished, packed beside the tables (committed with them)
        pack_spec(base_dir, results_dir / "records")
    report = spec.get("report", {})
    links = [str(link) for link in report.get("links") or []]
    with report_lock(runs_dir):
        failures = read_failures(runs_dir)
        try:
            target = report.get("target")
            if "target_from" in report:  # AlgoPerf's rule, from this spec's own finished runs
                target = spec_target(spec, runs_dir, args.conf_dir if args.set_target else None)
            runs = write_report(runs_dir, results_dir, shown, columns=report.get("columns"),
                                notes=spec.get("description"), target=target, strict=args.strict,
                                reference=method_info(report.get("reference", "adamw")).label, links=links)
            if links:  # simulated runs at links they never used: the cost model's time
                write_modelled(runs, results_dir, links)
                print(f"modelled wall-clock in {results_dir / 'modelled_time.md'}")
            if "netem" in spec:  # measured and modelled step times per link, time to target per link
                value = Target.of(target).value if target is not None else None
                write_wallclock(runs_dir, results_dir, value)
                print(f"wall-clock tables in {results_dir / 'wallclock.md'}")
            print(f"{len(runs)} runs reported in {results_dir / 'results.md'}")
            render_index(results_dir.parent)  # results/index.html links every experiment's page
            print(f"page: {results_dir / 'index.html'} (all experiments: {results_dir.parent / 'index.html'})")
        except (FileNotFoundError, ValueError) as err:  # no finished run, a bad target, --strict
            print(f"distlion: error: {err}", file=sys.stderr)
            failed_sweeps += 1
    for record in failures:
        print(f"distlion: error: failed run {record['run_dir']}: {record['reason']}", file=sys.stderr)
    if failures or failed_sweeps:
        print(f"distlion: error: {len(failures)} failed run(s), {failed_sweeps} sweep(s) ended with an error; "
              "fix them and rerun the same command: finished runs are skipped", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
