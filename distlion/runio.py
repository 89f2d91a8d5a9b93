"""Run directories: resolved config, config hash, atomic writes, and never losing a finished run.

`RunDir` owns everything a run keeps on disk: the lock that keeps a second process out, the decision
to skip (same config finished) or refuse (another config's results), checkpoints and resuming from
them, the metrics file (truncated to the checkpoint's step on resume) and the summary.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import platform
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from omegaconf import DictConfig, OmegaConf

from distlion.device import resolve_device

# Settings that change where or how a run is reported, not what it computes.
# train.nonfinite: a run that finished under "error" had no non-finite gradient, so it is the same run
# under "skip" (a run that skipped steps says so in its summary).
# task.target: what the report measures a run against, not what the run computes (a target set later
# applies to finished runs).
_NOT_HASHED = ("logger", "experiment", "task.name", "task.target", "train.progress", "train.log_every",
               "train.checkpoint_every", "train.threads", "train.nonfinite", "train.local_eval_every",
               "cluster.nodes", "cluster.tasks_per_node", "cluster.gpus_per_node",  # where ranks run, not what
               "cluster.dist_backend")  # how ranks talk: every collective moves the same bytes (the device is hashed)


#: The run folder name conf/config.yaml gives Hydra: `distlion.cli.run_point` names the folder by the run's config
#: hash instead (`runs/<experiment>/<hash>/`), which Hydra cannot know before it composes the config.
HASH_DIR = "@config_hash"


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)


def config_hash(cfg: DictConfig, device: bool = True) -> str:
    """A hash of everything that determines the run's numbers. `device=False`: of everything but the device, the
    identity a checkpoint keeps when its run resumes on another device (`RunDir.load_checkpoint`)."""
    config = resolved_config(cfg)
    not_hashed = list(_NOT_HASHED)
    # Settings added after runs were made count only when they change what those runs computed, so
    # a finished fp32 run keeps its hash (master weights only matter below fp32).
    if config.get("train", {}).get("dtype", "float32") == "float32":
        not_hashed += ["train.dtype", "train.master_weights"]
    # A run with the test evaluation (the default, and every run made before the setting) keeps its hash; a
    # tuning trial without it is another run, so a final run is never skipped as the trial's finished twin.
    if config.get("train", {}).get("test_eval", True):
        not_hashed.append("train.test_eval")
    # The device: a CPU run (all runs made before the setting) keeps its hash; a CUDA run is another run (its float
    # ops differ), whichever GPU index it took. Mixed precision and compilation likewise count only when on.
    train = config.get("train", {})
    if "device" in train:
        setting = str(train["device"])
        train["device"] = resolve_device(setting).type if setting == "auto" else setting.partition(":")[0]
        if train["device"] == "cpu" or not device:
            not_hashed.append("train.device")
    if train.get("amp", "none") == "none":
        not_hashed.append("train.amp")
    if not train.get("compile", False):
        not_hashed.append("train.compile")
    if config.get("cluster", {}).get("link") is None:  # runs made before links keep their hash
        not_hashed.append("cluster.link")
    # Outputs added later (a saved model, few-shot scores): a run without them keeps its hash, and one that asks
    # for them is another run (a finished run without them is not its twin).
    if not config.get("train", {}).get("save_model", False):
        not_hashed.append("train.save_model")
    if not config.get("eval", {}).get("tasks"):
        not_hashed.append("eval")
    # The last step's sync changes only methods that sync every H steps, and runs made before it did not sync there.
    if not (config.get("train", {}).get("final_sync", False) and "sync_every" in config.get("method", {})):
        not_hashed.append("train.final_sync")
    if not config.get("cluster", {}).get("faults", {}).get("k"):  # honest workers: the runs made before faults
        not_hashed.append("cluster.faults")
    if config.get("cluster", {}).get("shards", "iid") == "iid":  # IID shards: the runs made before the setting
        not_hashed += ["cluster.shards", "cluster.alpha"]
    for dotted in not_hashed:
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


@contextmanager
def exclusive_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock (one per torchrun rank) so that two processes never write one run.

    An flock is released by the kernel when its process dies, so a killed run never leaves it held. The
    lock file is removed when the run ends, by its holder only, while still holding it; a process that
    locks a file its holder removed meanwhile sees that the path no longer names that file and tries again.
    """
    path = run_dir / f".lock{os.environ.get('RANK', '')}"
    while True:
        lock = path.open("a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RunDirBusy(
                f"{run_dir} is being written by another process (a second copy of this run or sweep?); "
                "wait for it to finish or stop it, then rerun"
            ) from None
        if _names(path, lock):
            break
        lock.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        lock.close()


def _names(path: Path, file: IO[str]) -> bool:
    """Whether `path` still names the open `file` (not removed, nor replaced by a new file)."""
    try:
        return os.stat(path).st_ino == os.fstat(file.fileno()).st_ino
    except FileNotFoundError:
        return False


class RunDirBusy(ValueError):
    """Another live process holds the run directory."""


class WriteFailed(OSError):
    """A file of the run could not be written (a full disk, a read-only folder): the path and why, in one line.
    Its temporary file is gone and the file it was to replace is as it was."""

    def __init__(self, path: Path, cause: OSError):
        reason = os.strerror(cause.errno).lower() if cause.errno else str(cause)
        super().__init__(cause.errno, f"cannot write {path}: {reason} (it keeps what it held before, if anything); "
                                      "free space or fix the folder's permissions, then rerun", str(path))

    def __str__(self) -> str:
        return self.strerror


def _os_error(err: BaseException) -> OSError | None:
    """The OSError behind a failed write: torch.save reports one (ENOSPC) as a RuntimeError ("unexpected pos")
    raised while handling it."""
    if isinstance(err, OSError):
        return err
    if isinstance(err, RuntimeError) and isinstance(err.__context__, OSError):
        return err.__context__
    return None


@contextmanager
def _writing(path: Path, tmp: Path) -> Iterator[None]:
    """Write `tmp` on the way to `path`: a failed write removes `tmp` and becomes one `WriteFailed` naming `path`."""
    try:
        yield
    except BaseException as err:
        tmp.unlink(missing_ok=True)  # a partial file (e.g. 1 MB of a checkpoint) is never left behind
        cause = _os_error(err) if isinstance(err, Exception) else None  # Ctrl-C stays Ctrl-C
        if cause is None or isinstance(err, WriteFailed):
            raise
        raise WriteFailed(path, cause) from err


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with _writing(path, tmp):
        tmp.write_text(text)
        os.replace(tmp, path)


#: What specs write into the checkout themselves (reports, tuning tables, run records): a change there does not
#: make the code that produced a result dirty (a resumed spec rewrites its tuning.md before its runs start).
OUTPUT_DIRS = ("results", "runs")


def git_version(root: Path | None = None) -> dict[str, Any]:
    """Commit and dirty flag of the code that produced a result (None outside a git checkout): dirty when a tracked
    file outside `OUTPUT_DIRS` differs from the commit."""
    root = Path(__file__).resolve().parent.parent if root is None else root
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                *(f":(exclude){d}" for d in OUTPUT_DIRS)], cwd=root,
                               capture_output=True, text=True, check=True)
        return {"git_sha": sha.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.CalledProcessError):
        return {"git_sha": None, "git_dirty": None}


def machine(device: torch.device) -> dict[str, Any]:
    """Where a result was computed, for its summary: the same config gives other float results on another CPU model
    or torch build, so a table that mixes machines can say so."""
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), None)
    return {
        "host": platform.node(),
        "cpu": cpu or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "python": platform.python_version(),
    }


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


class RunDirConflict(ValueError):
    """The run directory holds results or a checkpoint of another config."""


class CheckpointUnreadable(ValueError):
    """No checkpoint of the run can be read (truncated, empty, or holding more than tensors and plain data)."""


class RunDir:
    """One run's directory for the config whose hash is `config_hash`.

    Files: config.yaml, metrics.jsonl and summary.json (written by the main process only),
    checkpoint<suffix>.pt and the previous checkpoint<suffix>.prev.pt (one per process: `suffix` is the backend's
    `shard_suffix`), .lock<RANK> while a process holds the run.
    """

    def __init__(self, path: str | Path, config_hash: str, portable_hash: str | None = None):
        self.path = Path(path)
        self.config_hash = config_hash
        # The config but its device: a checkpoint written on another device (a CPU run resumed on a GPU) resumes.
        self.portable_hash = portable_hash or config_hash
        self.metrics_path = self.path / "metrics.jsonl"

    @contextmanager
    def hold(self) -> Iterator[RunDir]:
        """The directory, created and locked for the life of the run."""
        self.path.mkdir(parents=True, exist_ok=True)
        with exclusive_run_dir(self.path):
            yield self

    def finished(self) -> dict[str, Any] | None:
        """The summary of a finished run of this config (to skip it), None if there is none; a finished run
        of another config is refused."""
        summary = read_summary(self.path)
        if summary is not None and summary.get("config_hash") != self.config_hash:
            raise RunDirConflict(
                f"{self.path} holds a finished run of another config (hash {summary.get('config_hash')} != "
                f"{self.config_hash}); choose another experiment= or hydra.run.dir, finished results are never "
                "overwritten"
            )
        return summary

    def checkpoint_path(self, suffix: str) -> Path:
        return self.path / f"checkpoint{suffix}.pt"

    def previous_checkpoint_path(self, suffix: str) -> Path:
        return self.path / f"checkpoint{suffix}.prev.pt"

    def save_checkpoint(self, suffix: str, state: dict[str, Any]) -> None:
        """Write the checkpoint atomically; the one it replaces is kept as the previous one, should the new one
        turn out unreadable (a disk that lost the last write)."""
        path = self.checkpoint_path(suffix)
        tmp = path.with_name(path.name + ".tmp")
        with _writing(path, tmp), tmp.open("wb") as file:
            torch.save({"config_hash": self.config_hash, "portable_hash": self.portable_hash, **state}, file)
            file.flush()
            os.fsync(file.fileno())
        # Only a complete new checkpoint moves the last one to `prev`: a failed write leaves both as they were.
        if path.exists():
            os.replace(path, self.previous_checkpoint_path(suffix))
        os.replace(tmp, path)

    def load_checkpoint(self, suffix: str, at_most: int | None = None) -> dict[str, Any] | None:
        """The checkpoint this process wrote, if any: the latest, or the previous one when the latest is
        unreadable (said in one line) or past step `at_most`; one of another config is refused."""
        latest, previous = self.checkpoint_path(suffix), self.previous_checkpoint_path(suffix)
        errors: dict[Path, str] = {}
        for path in (latest, previous):
            if not path.exists():
                continue
            try:
                checkpoint = _read_checkpoint(path)
            except CheckpointUnreadable as err:
                errors[path] = str(err)
                continue
            if at_most is not None and checkpoint["step"] > at_most:
                continue
            if checkpoint["config_hash"] != self.config_hash and \
                    checkpoint.get("portable_hash", checkpoint["config_hash"]) != self.portable_hash:
                raise RunDirConflict(
                    f"{path} was written by another config (hash {checkpoint['config_hash']} != "
                    f"{self.config_hash}); rerun with the original settings, or delete the checkpoint to start over"
                )
            if latest in errors:
                # Gone, so that the next checkpoint does not push this good one out as "previous".
                latest.unlink()
                print(f"distlion: checkpoint {latest} is unreadable ({errors[latest]}); removed it, resuming from "
                      f"the previous one at step {checkpoint['step']}", file=sys.stderr)
            return checkpoint
        if not errors:
            return None
        paths = " and ".join(str(p) for p in errors)
        raise CheckpointUnreadable(
            f"checkpoint {paths} {'is' if len(errors) == 1 else 'are'} unreadable ({'; '.join(errors.values())}) "
            f"and no readable previous one is left; delete {'it' if len(errors) == 1 else 'them'} to start the "
            "run over"
        )

    def open_metrics(self, resumed_step: int) -> IO[str]:
        """metrics.jsonl for appending, without the lines a run resumed at `resumed_step` will write again."""
        if self.metrics_path.exists():
            lines = [line for line in self.metrics_path.read_text().splitlines()
                     if line and json.loads(line)["step"] <= resumed_step]
            atomic_write_text(self.metrics_path, "".join(line + "\n" for line in lines))
        return self.metrics_path.open("a")

    def write_config(self, cfg: DictConfig) -> None:
        atomic_write_text(self.path / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=2))

    def remove_checkpoint(self, suffix: str) -> None:
        """A finished run needs no checkpoint."""
        latest = self.checkpoint_path(suffix)
        for path in (latest, latest.with_name(latest.name + ".tmp"), self.previous_checkpoint_path(suffix)):
            path.unlink(missing_ok=True)


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's contents. Only tensors and plain data are unpickled (weights_only), so a file
    tampered with in a shared run directory cannot run code."""
    try:
        with warnings.catch_warnings():  # e.g. torch's pickle-protocol notice: the reason says what matters
            warnings.simplefilter("ignore")
            # Onto the CPU, so a checkpoint a GPU run wrote reads anywhere (the runner moves it to its device).
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged file fails in many ways: EOFError, RuntimeError, OSError, KeyError...
        raise CheckpointUnreadable(_reason(err)) from err
    if not isinstance(checkpoint, dict) or not {"config_hash", "step"} <= checkpoint.keys():
        raise CheckpointUnreadable("not a distlion checkpoint")
    return checkpoint


_TORCH_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _reason(err: Exception) -> str:
    """`err` in a few words: its type and the first sentence that says what is wrong."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if isinstance(err, pickle.UnpicklingError):
        # torch's weights-only refusal wraps its reason in advice, e.g. to load with weights_only=False: the one
        # thing not to do with a file that may have been tampered with.
        lines = [line for line in lines if not line.startswith(_TORCH_ADVICE)] or lines
    sentence = lines[0].split(". ")[0].rstrip(".")[:200] if lines else ""
    return f"{type(err).__name__}: {sentence}" if sentence else type(err).__name__
