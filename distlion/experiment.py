"""Run an experiment spec: `distlion-experiment experiments/demo.yaml` (or `make experiment NAME=demo`).

A spec (see `experiments/`) names its grid as Hydra multirun sweeps and the seeds. Each sweep runs as
one `python -m distlion.train -m ...` into `runs/<name>/`, where every grid point has a fixed directory;
rerunning the same command skips finished runs and resumes killed ones. Then the report (tables, CSVs,
plots) is written into `results/<name>/` with the command that made it.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

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
    if not args.report_only:
        launcher = [] if args.jobs <= 1 else ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.jobs}"]
        for command in sweep_commands(spec, args.overrides + launcher, runs_dir):
            print("+", shlex.join(command[1:]), flush=True)
            subprocess.run(command, cwd=REPO, check=True)
    shown = shlex.join(["distlion-experiment", str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
                        *args.overrides, *(["--jobs", str(args.jobs)] if args.jobs > 1 else [])])
    report = spec.get("report", {})
    runs = write_report(runs_dir, results_dir, shown, columns=report.get("columns"), notes=spec.get("description"))
    print(f"{len(runs)} runs reported in {results_dir / 'results.md'}")


if __name__ == "__main__":
    main()
