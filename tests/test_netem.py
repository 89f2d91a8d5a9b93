"""`distlion-netem`: per-rank links of a known rate, their cleanup however a job ends, and real gloo jobs.

Building namespaces needs root and iproute2; without them these tests skip and say why. The command line
runs as a subprocess of netem.py itself (not the console script, whose `import distlion` loads torch and
takes seconds on a busy machine), so its pid names its namespaces and it can be sent signals.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlion import netem

REASON = netem.unavailable_reason()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"distlion-netem unavailable here: {REASON}")
CLI = [sys.executable, "-c", f"import runpy; runpy.run_path({netem.__file__!r}, run_name='__main__')"]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ALL_REDUCE = """
import datetime, os, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.full((1000,), dist.get_rank() + 1.0)
dist.all_reduce(t)
os.write(1, f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.sum().item():g}\\n".encode())
dist.destroy_process_group()
"""


def owned(pid: int) -> list[str]:
    return [n for n in netem._namespaces() if n.startswith(f"{netem.PREFIX}{pid}-")]


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def running_ranks(process: subprocess.Popen, ranks: int, timeout: float = 60.0) -> list[list[int]]:
    """The pids running in each rank's namespace of `process`, once every rank has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        pids = [subprocess.run(["ip", "netns", "pids", f"{netem.PREFIX}{process.pid}-0-r{r}"],
                               capture_output=True, text=True).stdout.split() for r in range(ranks)]
        if all(pids):
            return [[int(p) for p in rank] for rank in pids]
        time.sleep(0.1)
    raise AssertionError(f"ranks never started: {process.communicate(timeout=30)}")


def dead(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or "(Z)" in Path(f"/proc/{pid}/stat").read_text()


def test_not_root_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setattr(netem, "_privileged", lambda: False)
    assert netem.main(["--ranks", "2", "--rate", "100mbit", "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("distlion-netem: error: needs root (CAP_NET_ADMIN"), err
    monkeypatch.setattr(netem.shutil, "which", lambda tool: None)
    assert netem.main(["--rate", "1gbit", "--check"]) == 2
    error = "distlion-netem: error: ip and tc not found: install iproute2"
    assert capsys.readouterr().err.strip().splitlines() == [error]


def test_torchrun_becomes_one_node_per_namespace():
    topology = netem.Topology(3, "1gbit", None, "dln1-0")
    command = [TORCHRUN, "--standalone", "--nproc_per_node=3", "--max-restarts", "1", "-m", "distlion.train", "a=1"]
    assert netem.torchrun_ranks(command) == 3
    rank2 = netem.rank_commands(command, topology, 1234)[2]
    assert rank2.argv == ["ip", "netns", "exec", "dln1-0-r2", TORCHRUN, "--nnodes", "3", "--nproc-per-node", "1",
                          "--node-rank", "2", "--master-addr", "10.77.0.1", "--master-port", "1234",
                          "--max-restarts", "1", "-m", "distlion.train", "a=1"]
    assert rank2.env["GLOO_SOCKET_IFNAME"] == "dln0" and rank2.env.get("RANK") == os.environ.get("RANK")
    plain = netem.rank_commands(["python", "x.py"], topology, 1234)[1]
    assert plain.argv[-2:] == ["python", "x.py"]
    assert {k: plain.env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "1234"}


@needs_root
def test_capped_link_measures_its_cap_and_uncapped_far_more():
    with netem.links(2, "100mbit") as capped:
        measured = netem.measure_rate(capped)
        # A step's message is timed from its first bytes: the bucket must not let a 1 MB one pass early (the
        # 256 KB burst of PAPER.md measured 128 Mbit/s here).
        short = netem.measure_rate(capped, nbytes=1 << 20, skip=0)
    assert 85e6 <= measured <= 115e6, measured
    assert short <= 110e6, short
    with netem.links(2, "none") as uncapped:
        assert uncapped.rate is None
        assert netem.measure_rate(uncapped, src=1, dst=0) > 3 * 100e6
    assert not owned(os.getpid())


@needs_root
def test_delay_adds_its_latency_or_says_netem_is_missing():
    try:
        with netem.links(2, None, "10ms") as topology:
            ping = subprocess.run(["ip", "netns", "exec", topology.namespace(0), "ping", "-c", "3", "-i", "0.2",
                                   "-q", topology.address(1)], capture_output=True, text=True)
    except netem.NetemError as error:
        assert "netem" in str(error) and not owned(os.getpid())
        pytest.skip(f"no delay here: {error}")
    if ping.returncode == 127 or "not found" in ping.stderr:
        pytest.skip("no ping here")
    average_ms = float(ping.stdout.strip().splitlines()[-1].split("/")[-3])
    assert 19 <= average_ms <= 30, ping.stdout  # a round trip crosses the one-way delay twice


@needs_root
def test_normal_run_checks_the_link_and_cleans_up():
    process = start("--ranks", "2", "--rate", "100mbit", "--", sys.executable, "-c", "pass")
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert "link check:" in out and "(cap 100.0 Mbit/s)" in out, out
    assert not owned(process.pid)


@needs_root
def test_crashing_rank_gives_its_exit_code_and_ends_the_others():
    script = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)"
    process = start("--ranks", "2", "--rate", "1gbit", "--no-check", "--", sys.executable, "-c", script)
    process.communicate(timeout=60)
    assert process.returncode == 3
    assert not owned(process.pid)


@needs_root
def test_killed_rank_ends_the_job_and_cleans_up():
    process = start("--ranks", "2", "--rate", "1gbit", "--no-check", "--", "sleep", "60")
    pids = running_ranks(process, 2)
    os.kill(pids[1][0], signal.SIGKILL)
    process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGKILL
    assert not owned(process.pid) and dead(pids[0][0])


@needs_root
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signalled_netem_ends_the_ranks_and_cleans_up(signum):
    process = start("--ranks", "2", "--rate", "1gbit", "--no-check", "--", "sleep", "60")
    pids = running_ranks(process, 2)
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signum, err
    assert not owned(process.pid) and all(dead(rank[0]) for rank in pids)


@needs_root
def test_namespaces_of_a_killed_netem_are_removed_at_the_next_start():
    process = start("--ranks", "2", "--rate", "1gbit", "--no-check", "--", "sleep", "60")
    running_ranks(process, 2)
    process.kill()
    process.communicate(timeout=30)
    assert len(owned(process.pid)) == 3  # a SIGKILL leaves them: the hub and two ranks
    with netem.links(1, "1gbit"):
        assert not owned(process.pid)


@needs_root
@pytest.mark.parametrize("launcher", ["env", "torchrun"])
def test_gloo_all_reduce_across_namespaces(launcher, tmp_path):
    if launcher == "torchrun":  # --ranks comes from --nproc-per-node, and --standalone is dropped
        script = tmp_path / "all_reduce.py"
        script.write_text(ALL_REDUCE)
        args = ["--", TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script)]
    else:
        args = ["--ranks", "2", "--", sys.executable, "-c", ALL_REDUCE]
    process = start("--rate", "1gbit", "--no-check", *args)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0, err
    assert sorted(re.findall(r"rank \d+ of \d+: sum \d+", out)) == [
        "rank 0 of 2: sum 3000", "rank 1 of 2: sum 3000"], (out, err)
    assert not owned(process.pid)
