"""One bad grid point never costs a sweep (issue 12): a failing point is recorded with its reason while
the others run, a second copy of a sweep skips what the first holds, killing the driver ends every
process of the sweep and a rerun finishes it, and every bad setting leads with one `distlion: error:`
line that says what to change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distlion.train import run

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

LR_SPEC = """
name: lr
base: [task=digits, train.steps=3, cluster.per_worker_batch=8, logger=none, train.progress=false]
sweeps:
  - method.lr=-1,0.001,0.002
"""


def point(out: Path, lr: str) -> Path:
    """The folder of the spec's point at `lr`: named by its config hash."""
    from hydra import compose, initialize_config_dir

    from distlion.runio import config_hash

    overrides = ["experiment=lr", "task=digits", "train.steps=3", "cluster.per_worker_batch=8", "logger=none",
                 "train.progress=false", f"method.lr={lr}", "seed=0"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return out / "runs" / "lr" / config_hash(compose("config", overrides=overrides))


def experiment(spec: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "distlion.experiment", str(spec), "--out", str(out), *args]


HOLD_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_a_failing_point_is_recorded_and_the_others_run(tmp_path):
    spec = tmp_path / "lr.yaml"
    spec.write_text(LR_SPEC)
    # An earlier failure of a point that now runs, and a point that another process holds.
    point(tmp_path, "0.001").mkdir(parents=True)
    (point(tmp_path, "0.001") / "failed.json").write_text('{"run_dir": "x", "reason": "an earlier failure"}')
    point(tmp_path, "0.002").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(point(tmp_path, "0.002") / ".lock")],
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"locked\n"
        first = subprocess.run(experiment(spec, tmp_path), cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert first.returncode == 1, first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    assert "distlion: error: 1 point(s) of the sweep failed; the others ran:" in first.stderr  # its child's exit
    failed = json.loads((point(tmp_path, "-1") / "failed.json").read_text())
    assert failed["reason"] == "method.lr=-1 must be > 0; set method.lr to a positive learning rate"
    assert "method.lr=-1" in failed["overrides"] and failed["time"]
    assert (point(tmp_path, "0.001") / "summary.json").exists()
    assert not (point(tmp_path, "0.001") / "failed.json").exists()  # it finished: the old failure is over
    held = point(tmp_path, "0.002")
    assert not (held / "summary.json").exists() and not (held / "failed.json").exists()
    assert any("skipping" in line and str(held) in line for line in first.stderr.splitlines())
    assert f"distlion: error: failed run {point(tmp_path, '-1')}: method.lr=-1 must be > 0" in first.stderr
    results = (tmp_path / "results" / "lr" / "results.md").read_text()
    assert "1 runs of task" in results
    assert "**1 failed run(s)**" in results and f"`{point(tmp_path, '-1').name}`: method.lr=-1 must be > 0" in results


def processes() -> dict[int, tuple[str, int, int, str]]:
    """Every process: pid -> (state, parent pid, session id, start time)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(stat.parent.name)] = (fields[0], int(fields[1]), int(fields[3]), fields[19])
    return found


def descendants(pid: int) -> dict[int, tuple[str, int, int, str]]:
    table, found, todo = processes(), {}, [pid]
    while todo:
        parent = todo.pop()
        for child, info in table.items():
            if info[1] == parent and child not in found:
                found[child] = info
                todo.append(child)
    return found


def alive(snapshot: dict[int, tuple[str, int, int, str]]) -> list[int]:
    """The processes of `snapshot` still running, or any other process in their sessions."""
    sessions = {info[2] for info in snapshot.values()} - {os.getsid(0)}
    now = processes()
    return [pid for pid, info in now.items() if info[0] != "Z" and (
        (pid in snapshot and snapshot[pid][3] == info[3]) or info[2] in sessions)]


KILL_SPEC = """
name: kill
base: [task=digits, train.steps=200, cluster.per_worker_batch=8, logger=none, train.progress=false]
sweeps:
  - method.lr=0.001,0.002
"""


def test_killing_the_driver_ends_the_sweep_and_a_rerun_finishes_it(tmp_path):
    spec = tmp_path / "kill.yaml"
    spec.write_text(KILL_SPEC)
    driver = subprocess.Popen(experiment(spec, tmp_path, "--jobs", "2"), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    snapshot = {}
    try:
        deadline = time.time() + 240
        while len(list(tmp_path.glob("runs/kill/*/.lock"))) < 2:  # both points are training
            assert driver.poll() is None and time.time() < deadline
            time.sleep(0.2)
        snapshot = descendants(driver.pid)
        assert len(snapshot) >= 4  # group leader, Hydra, two joblib workers (and loky's resource tracker)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.time() + 5
        while alive(snapshot) and time.time() < deadline:
            time.sleep(0.1)
        assert alive(snapshot) == []
    finally:
        for pid in alive(snapshot):  # only if the test failed: leave nothing running
            os.kill(pid, signal.SIGKILL)
        driver.kill()
        driver.wait()
    assert len(list(tmp_path.glob("runs/kill/*/summary.json"))) < 2

    rerun = subprocess.run(experiment(spec, tmp_path, "--jobs", "2"), cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in tmp_path.glob("runs/kill/*/summary.json")]
    assert sorted(s["lr"] for s in summaries) == [0.001, 0.002]
    for metrics in tmp_path.glob("runs/kill/*/metrics.jsonl"):
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert steps == list(range(10, 201, 10))
    assert "2 runs of task" in (tmp_path / "results" / "kill" / "results.md").read_text()


LOAD_BASE = ["task=digits", "train.steps=2", "cluster.per_worker_batch=4", "logger=none", "train.progress=false"]
LOAD_SPEC = f"""
name: load
base: [{", ".join(LOAD_BASE)}]
sweeps:
  - method=dlion,lion cluster.workers=2,4
seeds: [0, 1, 2, 3]
"""


def test_two_copies_of_a_sweep_train_every_point_exactly_once(tmp_path, make_cfg):
    spec = tmp_path / "load.yaml"
    spec.write_text(LOAD_SPEC)
    copies = [subprocess.Popen(experiment(spec, tmp_path, "--jobs", "4"), cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [copy.communicate(timeout=400) for copy in copies]
    for copy, (_, err) in zip(copies, outputs):
        assert copy.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    stderr = [line for _, err in outputs for line in err.splitlines()]

    points = sorted(p.parent for p in tmp_path.glob("runs/load/*/summary.json"))
    assert len(points) == 16
    for directory in points:
        skipped = sum("skipping" in line and str(directory) in line for line in stderr)
        assert skipped == 1, f"{directory.name} trained {2 - skipped} times"
        summary = json.loads((directory / "summary.json").read_text())
        steps = [json.loads(line)["step"] for line in (directory / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]
        # The same numbers as the point run on its own.
        alone = run(make_cfg(*summary["overrides"]), tmp_path / "alone" / directory.name)
        assert summary["params_sha256"] == alone["params_sha256"] and summary["config_hash"] == alone["config_hash"]
    assert "16 runs of task" in (tmp_path / "results" / "load" / "results.md").read_text()


def train(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    flags, overrides = [a for a in args if a.startswith("-")], [a for a in args if not a.startswith("-")]
    return subprocess.run([sys.executable, "-m", "distlion.train", *flags, "logger=none", "train.steps=3",
                           "train.progress=false", f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=120)


# A bad setting, and the start of the line that must lead its error output.
BAD_SETTINGS = {
    "unknown option": (["method=foo"], "method=foo is not an option; choose one of method=adamw|ddp|ddp_bf16|"),
    "unknown option in a sweep": (["-m", "method=dlion,lino"],
                                  "method=lino is not an option (did you mean method=lion?); choose one of"),
    "typo'd key": (["train.stepz=3"], "train.stepz is not a setting; did you mean train.steps?"),
    "typo'd group key": (["cluster.worker=2"], "cluster.worker is not a setting; did you mean cluster.workers?"),
    "key of another option": (["task=digits", "task.data=x"],
                              "task.data is not a setting of the chosen task; it is one of task=cifar10|"),
    "missing data set": (["task=cifar10", "model=vit_cifar_cpu", "task.data=/no/cifar10"],
                         "CIFAR-10 not found at /no/cifar10; set"),
}


@pytest.fixture(scope="module")
def bad_settings(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every bad-setting command, run three at a time (each is mostly imports)."""
    root = tmp_path_factory.mktemp("bad")
    with ThreadPoolExecutor(3) as pool:
        done = pool.map(lambda item: train(*item[1][0], tmp_path=root / str(item[0])), enumerate(BAD_SETTINGS.values()))
        return dict(zip(BAD_SETTINGS, done))


@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_a_bad_setting_leads_with_one_line_that_says_what_to_change(case, bad_settings):
    done, line = bad_settings[case], BAD_SETTINGS[case][1]
    assert done.returncode != 0
    assert done.stderr.splitlines()[0].startswith(f"distlion: error: {line}"), done.stderr
    assert "Traceback" not in done.stderr
