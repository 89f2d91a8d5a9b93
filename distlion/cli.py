"""The command line around Hydra: one `distlion: error:` line for every bad setting, and sweeps that
survive a bad grid point.

`run_app` runs the Hydra app of `distlion.train`: Hydra's own errors (an unknown config option, a
typo'd key, ...) print one leading line that says what to change, then Hydra's information. `run_point`
runs one run: alone, a bad setting prints one line and exits 2; in a sweep (Hydra multirun) a failing
point is recorded in `failed.json` in its run directory with its one-line reason and the sweep goes
on, a point another live process is running is skipped, and the sweep exits 1 at the end if any point
failed. A point that later finishes drops its failure record.
"""

from __future__ import annotations

import datetime
import difflib
import hashlib
import json
import os
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, HydraException, InstantiationException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from distlion.comm.collectives import CollectiveError
from distlion.runio import HASH_DIR, RunDirBusy, RunDirConflict, config_hash

CONF = Path(__file__).resolve().parent.parent / "conf"
FAILED = "failed.json"  # a sweep point's failure record, in its run directory
# Where the points of this process's sweep (in this process or in joblib workers) append their failures.
_FAILURES_ENV = "DISTLION_SWEEP_FAILURES"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training; its message says where a rerun resumes (`run_app` prints it as one line)."""


def error_line(err: BaseException) -> str | None:
    """The one line that says what to change, for an error that a setting or the data caused; None for
    anything else (a bug, whose traceback is the useful report)."""
    if isinstance(err, InstantiationException):
        if not isinstance(err.__cause__, (ValueError, OSError)):
            return None
        err = err.__cause__  # a task's loader: a missing data set, a model that does not fit the data
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options:
        return _option_hint(err.missing_cfg_file, list(err.options))
    unknown_key = isinstance(err.__cause__, (ConfigKeyError, ConfigAttributeError))
    if isinstance(err, ConfigCompositionException) and unknown_key:
        return _key_hint(err.__cause__.full_key or "")
    if isinstance(err, (HydraException, ValueError, FloatingPointError, OSError, CollectiveError)):
        return " ".join(str(err).split()) or type(err).__name__
    return None


def _option_hint(missing: str, options: list[str]) -> str:
    group, _, name = missing.rpartition("/")
    close = difflib.get_close_matches(name, options, n=1)
    mean = f" (did you mean {group}={close[0]}?)" if close else ""
    return f"{group}={name} is not an option{mean}; choose one of {group}={'|'.join(options)}"


def config_keys() -> dict[str, list[str]]:
    """Every setting of conf/ as a dotted key, with the group options that define it ('' for config.yaml)."""
    keys: dict[str, list[str]] = {}

    def add(node: Any, prefix: str, option: str) -> None:
        for key, value in node.items_ex(resolve=False):  # a mandatory `???` is a setting too
            if key in ("defaults", "hydra"):
                continue
            keys.setdefault(prefix + str(key), []).append(option)
            if isinstance(value, DictConfig):
                add(value, f"{prefix}{key}.", option)

    add(OmegaConf.load(CONF / "config.yaml"), "", "")
    for path in sorted(CONF.glob("*/*.yaml")):
        group = path.parent.name
        keys.setdefault(group, [])
        prefix = "" if "@package _global_" in path.read_text() else f"{group}."
        add(OmegaConf.load(path), prefix, f"{group}={path.stem}")
    return keys


def _key_hint(key: str) -> str:
    keys = config_keys()
    group = key.split(".")[0]
    options = sorted({o.split("=")[1] for o in keys.get(key, []) if o.startswith(group + "=")})
    if options:  # a setting of the group's other options
        return f"{key} is not a setting of the chosen {group}; it is one of {group}={'|'.join(options)}"
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.7)
    mean = f"did you mean {close[0]}?" if close else "see `python -m distlion.train --cfg job` for the settings"
    return f"{key} is not a setting; {mean} (+{key}=... adds a new one)"


def hash_named(run_dir: Path, cfg: DictConfig, overrides: list[str]) -> Path:
    """The run's folder: Hydra's, or where conf/config.yaml leaves the name to us (`HASH_DIR`), the config hash
    beside it, so that a config has one folder whatever overrides spelled it. A config that does not resolve gets a
    folder named by its overrides, where its failure is recorded."""
    if run_dir.name != HASH_DIR:
        return run_dir  # a folder the user named (hydra.run.dir=...)
    with suppress(OSError):
        run_dir.rmdir()  # the empty folder Hydra made under the placeholder name (another job may still hold it)
    try:
        name = config_hash(cfg)
    except Exception:  # noqa: BLE001 - the run reports what is wrong with the config, in this folder
        name = "unresolved-" + hashlib.sha256(" ".join(overrides).encode()).hexdigest()[:16]
    return run_dir.parent / name


def run_point(run: Callable[[DictConfig, Path], dict[str, Any]], cfg: DictConfig) -> dict[str, Any] | None:
    """`run(cfg, run_dir)` as Hydra's task, into the run directory Hydra chose; its summary, or None for a
    point of a sweep that failed (recorded) or that another process is running (skipped)."""
    hydra = HydraConfig.get()
    run_dir = hash_named(Path(hydra.runtime.output_dir), cfg, list(hydra.overrides.task))
    if hydra.mode != RunMode.MULTIRUN:
        try:
            return run(cfg, run_dir)
        except Exception as err:
            reason = error_line(err)
            if reason is None:
                raise
            print(f"distlion: error: {reason}", file=sys.stderr)
            sys.exit(2)
    try:
        summary = run(cfg, run_dir)
    except RunDirBusy:  # a second copy of the sweep: the copy that holds the point runs it
        print(f"distlion: skipping {run_dir}: another live process is running it (a second copy of the sweep?)",
              file=sys.stderr)
        return None
    except Exception as err:
        reason = error_line(err)
        if reason is None:  # a bug: its traceback, and the sweep goes on
            traceback.print_exc()
            reason = " ".join(f"{type(err).__name__}: {err}".split())
        print(f"distlion: error: {run_dir.name}: {reason}", file=sys.stderr)
        # Another config's finished run is never written to: its failure goes to the sweep's log only.
        record_failure(run_dir, reason, list(hydra.overrides.task), in_run_dir=not isinstance(err, RunDirConflict))
        return None
    (run_dir / FAILED).unlink(missing_ok=True)  # an earlier failure of this point is over
    return summary


def record_failure(run_dir: Path, reason: str, overrides: list[str], in_run_dir: bool = True) -> None:
    """`failed.json` in the run directory (unless `in_run_dir` is false), and a line in this sweep's failure log."""
    record = {"run_dir": str(run_dir), "reason": reason, "overrides": overrides,
              "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    if in_run_dir:
        run_dir.mkdir(parents=True, exist_ok=True)
        # A unique temporary name: a second copy of the sweep may record the same failure at the same time.
        fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{FAILED}.")
        with os.fdopen(fd, "w") as file:
            json.dump(record, file, indent=2)
        os.replace(tmp, run_dir / FAILED)
    if os.environ.get(_FAILURES_ENV):
        with open(os.environ[_FAILURES_ENV], "a") as log:  # one short appended line per failure
            log.write(json.dumps(record) + "\n")


def read_failures(root: Path) -> list[dict[str, Any]]:
    """The failure records of the run directories under `root`, by run directory."""
    return [json.loads(path.read_text()) for path in sorted(root.rglob(FAILED))]


def run_app(app: Callable[[], Any]) -> None:
    """Run the `hydra.main` app `app` from the command line. A Hydra error prints first one
    `distlion: error:` line saying what to change, then Hydra's own message (exit 1); a sweep with failed
    points lists them at the end and exits 1."""
    # Created by the first failure only, so that a run killed without one leaves nothing behind.
    failures = Path(tempfile.gettempdir()) / f"distlion-sweep-failures-{os.getpid()}-{uuid.uuid4().hex}.jsonl"
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    env = {_FAILURES_ENV: str(failures), "HYDRA_FULL_ERROR": "1"}  # the latter: Hydra raises its errors to us
    os.environ.update(env)
    try:
        app()
    except KeyboardInterrupt as err:  # Ctrl-C: where a rerun goes on, not the stack it hit
        print(f"distlion: {err or 'interrupted'}", file=sys.stderr, flush=True)
        sys.exit(130)  # the shell's code for SIGINT
    except Exception as err:
        line = error_line(err)
        if line is not None:
            print(f"distlion: error: {line}", file=sys.stderr, flush=True)
        if isinstance(err, OSError) and line is not None and full_error != "1":
            sys.exit(2)  # e.g. Hydra creating a run directory in a read-only folder: the line says it all
        if full_error == "1" or not isinstance(err, HydraException):
            raise
        print(err, file=sys.stderr)  # what Hydra prints: its message and the OmegaConf error under it
        if isinstance(err.__cause__, OmegaConfBaseException):
            print(err.__cause__, file=sys.stderr)
        print("\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.", file=sys.stderr)
        sys.exit(1)
    finally:
        for key in env:
            os.environ.pop(key)
        if full_error is not None:
            os.environ["HYDRA_FULL_ERROR"] = full_error
        failed = [json.loads(line) for line in failures.read_text().splitlines()] if failures.exists() else []
        failures.unlink(missing_ok=True)
    if failed:
        print(f"distlion: error: {len(failed)} point(s) of the sweep failed; the others ran:", file=sys.stderr)
        for record in failed:
            print(f"  {Path(record['run_dir']).name}: {record['reason']}", file=sys.stderr)
        sys.exit(1)
