"""Run an experiment spec: `distlion-experiment experiments/demo.yaml` (or `make experiment NAME=demo`).

A spec (see `experiments/`) names its grid as Hydra multirun sweeps and the seeds. Each sweep runs as
one `python -m distlion.train -m ...` into `runs/<name>/`, where every grid point has a fixed directory;
rerunning the same command skips finished runs and resumes killed ones. Then the report (tables, CSVs,
plots) is written into `results/<name>/` with the command that made it.

A failing grid point does not stop the others: it is recorded with its reason, the report is built
from the finished runs and lists it, and the command exits 1. A second copy of a running spec skips
the points the first one holds. Each sweep runs in its own process group under a small group leader
that ends the whole group, joblib workers included, when the driver dies, even by SIGKILL.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from omegaconf import OmegaConf

from distlion.cli import read_failures
from distlion.report import write_report

REPO = Path(__file__).resolve().parent.parent


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


def run_sweep(command: list[str]) -> int:
    """Run one sweep's command in its own process group; its exit status. The group ends with the driver:
    on Ctrl-C, SIGTERM (see `main`) or an error here at once, on SIGKILL through the group leader."""
    leader = subprocess.Popen([sys.executable, "-c", _GROUP_LEADER, str(os.getpid()), *command], cwd=REPO,
                              start_new_session=True)
    try:
        return leader.wait()
    except BaseException:
        with suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
        raise


@contextmanager
def report_lock(runs_dir: Path) -> Iterator[None]:
    """One report writer at a time: a second copy of the spec waits, then writes its own."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    with (runs_dir / ".report.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through run_sweep, which ends the sweep's group


def main() -> None:
    parser = argparse.ArgumentParser(description="Run an experiment spec, then write its tables and plots.")
    parser.add_argument("spec", help="a spec name in experiments/ or a path to one")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. logger=none)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the report from finished runs")
    parser.add_argument("--jobs", type=int, default=1,
                        help="grid points run at once (Hydra's joblib launcher); each run uses train.threads")
    parser.add_argument("--out", type=Path, default=REPO,
                        help="base folder of runs/<name>/ and results/<name>/ (default: the repository)")
    args = parser.parse_args()
    path, spec = load_spec(args.spec)
    runs_dir, results_dir = args.out.resolve() / "runs" / spec["name"], args.out.resolve() / "results" / spec["name"]
    failed_sweeps = 0
    if not args.report_only:
        signal.signal(signal.SIGTERM, _stop)
        launcher = [] if args.jobs <= 1 else ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.jobs}"]
        try:
            for command in sweep_commands(spec, args.overrides + launcher, runs_dir):
                print("+", shlex.join(command[1:]), flush=True)
                failed_sweeps += run_sweep(command) != 0
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the running sweep has ended
            print("distlion: stopped; rerun the same command to go on: finished runs are skipped", file=sys.stderr)
            sys.exit(130)
    shown = shlex.join(["distlion-experiment", str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
                        *args.overrides, *(["--jobs", str(args.jobs)] if args.jobs > 1 else [])])
    report = spec.get("report", {})
    with report_lock(runs_dir):
        failures = read_failures(runs_dir)
        try:
            runs = write_report(runs_dir, results_dir, shown, columns=report.get("columns"),
                                notes=spec.get("description"))
            print(f"{len(runs)} runs reported in {results_dir / 'results.md'}")
        except FileNotFoundError as err:  # no finished run: the failures below say why
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
