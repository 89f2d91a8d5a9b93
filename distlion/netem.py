"""Per-rank links of a known bandwidth on one machine: `distlion-netem --ranks 4 --rate 1gbit -- torchrun ...`.

Ranks on one machine talk through `lo` at memory speed, so a method's bits never cost time. Here every rank
runs in a network namespace of its own whose one interface (`dln0`) is a veth into a bridge in a hub
namespace, and a `tbf` on both ends of each veth (the rank's egress and the hub port's egress toward it)
caps each direction: every rank gets its own full-duplex link of the rate, as from a port of a switch.
Putting all ranks in one namespace does not work: their addresses are local to each other, so the traffic
goes through `lo` and never meets a veth's tbf (measured; see PAPER.md, "Emulating links on one machine").

`--rate none` builds the same topology without a tbf, so a capped and an uncapped run differ only in the
cap. `--delay` is the one-way latency between two ranks: a packet crosses two links (its sender's and its
receiver's), and each adds half of it (netem). Addresses are 10.77.0.<rank+1>/24, which exist only inside
the namespaces, so they cannot collide with the machine's; nothing is added to or shaped on the machine's
own interfaces.

The namespaces are named after the process that owns them (`dln<pid>-<n>-r<rank>`, `dln<pid>-<n>-hub`).
They are removed when the job ends, whichever way it ends (a failing or killed rank, Ctrl-C, SIGTERM); if
the owner itself was killed by SIGKILL, the next start finds them by name and removes them, and whatever
still runs in them.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

PREFIX = "dln"
INTERFACE = "dln0"  # the rank's interface, the same name in every rank's namespace
SUBNET = "10.77.0"
MTU = 1500
# tbf's bucket holds 2.5 ms of traffic at the rate (at least 32 KB): a step's messages then wait for the rate
# from their first bytes. Measured here, one timed transfer of 1 MB: 128 Mbit/s through a 100 Mbit/s cap with
# the 256 KB burst of PAPER.md (its first 256 KB pass at once), 99 Mbit/s with 32 KB; at 1 Gbit/s a 32 KB
# bucket starves the link (424-653 Mbit/s), 256 KB holds it (974 Mbit/s over 16 MB). Queue: 100 ms at the rate.
BURST_S, MIN_BURST_BYTES = 2.5e-3, 32 * 1024
TBF_LATENCY = ("latency", "100ms")


def tbf_burst(rate: str) -> str:
    """tbf's bucket for a rate: 2.5 ms of it, at least 32 KB, in tc's bytes."""
    return f"{max(MIN_BURST_BYTES, round(parse_rate(rate) / 8 * BURST_S))}b"
# Rank 0's namespace is created for this job and holds nothing else, so a fixed port cannot collide with
# anything on the machine or in another distlion-netem's namespaces.
MASTER_PORT = 29500
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_NAME = re.compile(rf"^{PREFIX}(\d+)-\d+-(hub|r\d+)$")
_topologies = itertools.count()  # several topologies of one process get distinct names


class NetemError(RuntimeError):
    """What this machine lacks or refused; `main` prints it as one error line."""


@dataclass(frozen=True)
class Topology:
    """The namespaces of one job: `ranks` rank namespaces and a hub, all named `<name>-...`."""

    ranks: int
    rate: str | None  # a tc rate, None for uncapped
    delay: str | None  # the one-way latency between two ranks, None for none
    name: str
    interface: str = INTERFACE

    @property
    def hub(self) -> str:
        return f"{self.name}-hub"

    def namespace(self, rank: int) -> str:
        return f"{self.name}-r{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def exec_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(rank)]


@dataclass(frozen=True)
class RankCommand:
    argv: list[str]
    env: dict[str, str]


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
               "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40}
_DELAY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_rate(text: str | None) -> float | None:
    """Bits/s of a tc rate ("100mbit", "1gbit"; "bps" is bytes/s, as in tc); None for "none" (uncapped)."""
    if text is None or text.lower() == "none":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", text.lower())
    if not match or match[2] not in _RATE_UNITS or float(match[1]) <= 0:
        raise NetemError(f"bad rate {text!r}: give a tc rate such as 100mbit, 1gbit, 10gbit, or none")
    return float(match[1]) * _RATE_UNITS[match[2]]


def parse_delay(text: str | None) -> float | None:
    """Seconds of a delay ("0.5ms", "100us", "1s"); None for "none" or zero."""
    if text is None or text.lower() in ("none", "0"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(s|ms|us)", text.lower())
    if not match:
        raise NetemError(f"bad delay {text!r}: give a time such as 0.5ms, 100us, or none")
    return float(match[1]) * _DELAY_UNITS[match[2]] or None


def _privileged() -> bool:
    """Whether this process may create namespaces and links: CAP_NET_ADMIN and CAP_SYS_ADMIN (mounting
    /run/netns), which root has unless a container took them away."""
    try:
        status = Path("/proc/self/status").read_text()
        effective = int(re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M)[1], 16)
    except (OSError, TypeError):
        return os.geteuid() == 0
    return bool(effective >> 12 & 1 and effective >> 21 & 1)


def unavailable_reason() -> str | None:
    """Why links cannot be built here (missing tools or privileges), or None."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2"
    if not _privileged():
        return "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces; rerun with sudo"
    return None


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no message"])[0]
        raise NetemError(f"`{shlex.join(command)}` failed: {reason}")
    return result.stdout


def _namespaces() -> list[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _remove_namespace(namespace: str) -> None:
    """Kill what still runs in `namespace` (only ranks of ours ever run there), then delete it; quiet."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def teardown(name: str) -> None:
    """Remove every namespace of topology `name`; idempotent. Signals wait until it is done, so that a
    second Ctrl-C cannot leave half of them behind."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        for namespace in _namespaces():
            if namespace.startswith(f"{name}-"):
                _remove_namespace(namespace)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces whose owner no longer runs (a distlion-netem killed by SIGKILL); their names."""
    stale = [n for n in _namespaces() if (m := _NAME.match(n)) and not _alive(int(m[1]))]
    for namespace in stale:
        _remove_namespace(namespace)
    return stale


def _shape(namespace: str, device: str, rate: str | None, delay_s: float | None) -> None:
    """The qdiscs of one end of a link: netem holding half the one-way delay, then tbf at the rate."""
    add = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
    parent = ["root"]
    if delay_s:
        # netem's queue holds what is in flight during the delay; 100k packets never drop at 10 Gbit/s.
        try:
            _run([*add, "root", "handle", "1:", "netem", "delay", f"{delay_s / 2 * 1e6:g}us", "limit", "100000"])
        except NetemError as error:
            if "unknown" in str(error):
                raise NetemError("--delay needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM); "
                                 "run without --delay") from None
            raise
        parent = ["parent", "1:1", "handle", "10:"]
    if rate:
        _run([*add, *parent, "tbf", "rate", rate, "burst", tbf_burst(rate), *TBF_LATENCY])


def _build(topology: Topology) -> None:
    hub, interface = topology.hub, topology.interface
    try:
        _run(["ip", "netns", "add", hub])
    except NetemError as error:
        raise NetemError(f"cannot create a network namespace ({error}); distlion-netem needs root "
                         "(CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's ip and tc") from None
    _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
    _run(["ip", "-n", hub, "link", "set", "br0", "up"])
    delay_s = parse_delay(topology.delay)
    for rank in range(topology.ranks):
        namespace, port = topology.namespace(rank), f"r{rank}"
        _run(["ip", "netns", "add", namespace])
        # Made in the hub with its peer put straight into the rank's namespace, so no interface ever
        # appears among the machine's own.
        _run(["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", interface, "netns", namespace])
        _run(["ip", "-n", hub, "link", "set", port, "mtu", str(MTU), "master", "br0", "up"])
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])
        _run(["ip", "-n", namespace, "link", "set", interface, "mtu", str(MTU), "up"])
        _run(["ip", "-n", namespace, "addr", "add", f"{topology.address(rank)}/24", "dev", interface])
        _shape(namespace, interface, topology.rate, delay_s)
        _shape(hub, port, topology.rate, delay_s)


@contextmanager
def links(ranks: int, rate: str | None = None, delay: str | None = None) -> Iterator[Topology]:
    """Build `ranks` namespaces, each with its own link of `rate` (a tc rate; None or "none": uncapped)
    into a hub, with `delay` of one-way latency between two ranks; removed again on the way out."""
    reason = unavailable_reason()
    if reason:
        raise NetemError(reason)
    if not 1 <= ranks <= 253:
        raise NetemError(f"--ranks must be 1..253 (one /24), not {ranks}")
    rate = None if parse_rate(rate) is None else rate
    delay = None if parse_delay(delay) is None else delay
    remove_stale()
    topology = Topology(ranks, rate, delay, f"{PREFIX}{os.getpid()}-{next(_topologies)}")
    try:
        _build(topology)
        yield topology
    finally:
        teardown(topology.name)


# The two ends of `measure_rate`, run inside rank namespaces. The receiver times the bytes after the first
# `skip` ones, so that tbf's initial burst and TCP's slow start do not count.
_RECEIVER = """
import socket, sys, time
address, nbytes, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = socket.create_server((address, 0))
server.settimeout(30)
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.settimeout(30)
view = memoryview(bytearray(1 << 20))
got, start, t0 = 0, 0, 0.0
while got < nbytes:
    n = conn.recv_into(view)
    if not n:
        break
    if not start and got + n >= skip:
        start, t0 = got + n, time.perf_counter()
    got += n
elapsed = time.perf_counter() - t0
conn.sendall(b"k")
print((got - start) * 8 / elapsed)
"""
_SENDER = """
import socket, sys
address, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
chunk = memoryview(bytes(1 << 20))
with socket.create_connection((address, port), timeout=30) as conn:
    sent = 0
    while sent < nbytes:
        conn.sendall(chunk[:min(len(chunk), nbytes - sent)])
        sent += min(len(chunk), nbytes - sent)
    conn.recv(1)
"""
_SKIP = 1 << 20


def check_bytes(rate: str | None) -> int:
    """Bytes for a transfer of about half a second at `rate` (2 to 64 MB), plus the untimed start."""
    bps = parse_rate(rate)
    timed = 64 << 20 if bps is None else min(max(int(bps * 0.5 / 8), 2 << 20), 64 << 20)
    return timed + _SKIP


def measure_rate(topology: Topology, src: int = 0, dst: int = 1, nbytes: int | None = None,
                 timeout: float = 60.0, skip: int | None = None) -> float:
    """Bits/s of payload in one TCP transfer from rank `src` to rank `dst`, timed after its first `skip` bytes
    (default: up to 1 MB, past the bucket's burst and TCP's slow start). A little below a cap, since tbf
    counts headers: 1448 payload bytes travel in 1514 at MTU 1500, so 100mbit gives about 95.6 Mbit/s."""
    nbytes = check_bytes(topology.rate) if nbytes is None else nbytes
    skip = min(_SKIP, nbytes // 4) if skip is None else skip
    address = topology.address(dst)
    receiver = subprocess.Popen([*topology.exec_prefix(dst), sys.executable, "-c", _RECEIVER, address,
                                 str(nbytes), str(skip)], stdout=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()
        sender = subprocess.run([*topology.exec_prefix(src), sys.executable, "-c", _SENDER, address, port,
                                 str(nbytes)], capture_output=True, text=True, timeout=timeout)
        out, _ = receiver.communicate(timeout=timeout)
        if sender.returncode or receiver.returncode or not out.strip():
            raise NetemError(f"link check failed: {(sender.stderr.strip().splitlines() or ['no output'])[-1]}")
        return float(out)
    except subprocess.TimeoutExpired:
        raise NetemError(f"link check rank{src}->rank{dst} took over {timeout:g} s") from None
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


_TORCHRUN_FLAGS = {"--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path",
                   "--virtual-local-rank", "--virtual_local_rank"}
# Replaced by the one-process node of each namespace (static rendezvous at rank 0's address: the c10d
# backend times out, since every namespace has the same hostname).
_TORCHRUN_REPLACED = {"--standalone", "--nnodes", "--nproc-per-node", "--nproc_per_node", "--node-rank",
                      "--node_rank", "--master-addr", "--master_addr", "--master-port", "--master_port",
                      "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id",
                      "--rdzv_id", "--rdzv-conf", "--rdzv_conf"}


def _torchrun_parts(command: list[str]) -> tuple[list[str], list[tuple[str, list[str]]], list[str]] | None:
    """(the launcher, its options as (name, tokens), the script and its arguments) if `command` runs torchrun."""
    if Path(command[0]).name == "torchrun":
        head = 1
    elif Path(command[0]).name.startswith("python") and command[1:3] == ["-m", "torch.distributed.run"]:
        head = 3
    else:
        return None
    options, i = [], head
    while i < len(command) and command[i].startswith("-"):
        name = command[i].partition("=")[0]
        size = 1 if "=" in command[i] or name in _TORCHRUN_FLAGS else 2
        options.append((name, command[i:i + size]))
        i += size
    return command[:head], options, command[i:]


def torchrun_ranks(command: list[str]) -> int | None:
    """The --nproc-per-node of a torchrun command, if it is one and gives a number."""
    parts = _torchrun_parts(command) if command else None
    for name, tokens in parts[1] if parts else []:
        value = tokens[0].partition("=")[2] or (tokens[1] if len(tokens) > 1 else "")
        if name in ("--nproc-per-node", "--nproc_per_node") and value.isdigit():
            return int(value)
    return None


def rank_commands(command: list[str], topology: Topology, port: int = MASTER_PORT,
                  measured: float | None = None) -> list[RankCommand]:
    """Each rank's argv (run in its namespace) and environment. A torchrun command becomes one one-process
    node per namespace; any other command gets the env:// variables. `measured`: the link check's bits/s."""
    parts = _torchrun_parts(command)
    world, master = topology.ranks, topology.address(0)
    commands = []
    for rank in range(world):
        # DISTLION_LINK: what the runner records as the run's link (and checks against cluster.link).
        env = {**os.environ, "GLOO_SOCKET_IFNAME": topology.interface, "DISTLION_LINK": topology.rate or "none"}
        if measured is not None:
            env["DISTLION_LINK_MEASURED"] = f"{measured:.6g}"  # bits/s of TCP payload, rank0 -> rank1
        if parts:
            launcher, options, script = parts
            kept = [token for name, tokens in options if name not in _TORCHRUN_REPLACED for token in tokens]
            argv = [*launcher, "--nnodes", str(world), "--nproc-per-node", "1", "--node-rank", str(rank),
                    "--master-addr", master, "--master-port", str(port), *kept, *script]
        else:
            argv = list(command)
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=master, MASTER_PORT=str(port))
        commands.append(RankCommand([*topology.exec_prefix(rank), *argv], env))
    return commands


def _die_with(parent: int) -> Callable[[], None]:
    def preexec() -> None:
        # A rank whose distlion-netem dies (even by SIGKILL) gets SIGTERM; what survives that is killed
        # with the namespaces at the next start.
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)  # it died before prctl
    return preexec


def _exit_status(code: int) -> int:
    return code if code >= 0 else 128 - code


def _stop(processes: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to the process group of every rank still running, SIGKILL after `grace_s`. Only groups of
    unreaped leaders are signalled: a reaped leader's group id may already belong to someone else."""
    for process in processes:
        if process.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_ranks(commands: list[RankCommand], grace_s: float = 5.0) -> int:
    """Run all ranks at once, each in its own process group (Ctrl-C reaches distlion-netem, which ends them);
    the first non-zero exit status (128+N for signal N), after which the others are ended, else 0."""
    processes: list[subprocess.Popen] = []
    try:
        for command in commands:
            processes.append(subprocess.Popen(command.argv, env=command.env, start_new_session=True,
                                              preexec_fn=_die_with(os.getpid())))
        running = list(processes)
        while running:
            for process in list(running):
                code = process.poll()
                if code is not None:
                    running.remove(process)
                    if code:
                        return _exit_status(code)
            time.sleep(0.05)
        return 0
    finally:
        _stop(processes, grace_s)


def _mbit(bps: float) -> str:
    return f"{bps / 1e6:,.1f} Mbit/s"


def check_link(topology: Topology) -> float:
    """Measure rank 0 -> rank 1 and say how it compares with the cap (a warning beyond 15%)."""
    measured, cap = measure_rate(topology), parse_rate(topology.rate)
    print(f"distlion-netem: link check: {_mbit(measured)} measured rank0->rank1 "
          f"({'uncapped' if cap is None else f'cap {_mbit(cap)}'})", flush=True)
    if cap is not None and abs(measured / cap - 1) > 0.15:
        print(f"distlion-netem: warning: the link measured {measured / cap:.0%} of its cap; the machine may be too "
              "busy to fill it, and times will not follow the rate", file=sys.stderr, flush=True)
    return measured


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupted(signum)  # unwinds through run_ranks and links, which end the ranks and the namespaces


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        prog="distlion-netem",
        description="Run a distributed job with every rank in its own network namespace, on its own link of a "
                    "set rate (tbf) and delay (netem); the namespaces are removed afterwards.",
        epilog="example: distlion-netem --ranks 4 --rate 1gbit -- torchrun -m distlion.train cluster=torchdist ...")
    parser.add_argument("--ranks", type=int, help="number of ranks (default: torchrun's --nproc-per-node)")
    parser.add_argument("--rate", required=True, help="each rank's link, both directions: a tc rate (100mbit, "
                                                      "1gbit, 10gbit) or none (same topology, uncapped)")
    parser.add_argument("--delay", help="one-way latency between two ranks (e.g. 0.5ms); half on each link")
    parser.add_argument("--master-port", type=int, default=MASTER_PORT,
                        help=f"rank 0's port inside its own namespace (default {MASTER_PORT})")
    check = parser.add_mutually_exclusive_group()
    check.add_argument("--check", action="store_true", help="only measure a link rank0->rank1 (no command)")
    check.add_argument("--no-check", action="store_true", help="skip the link check before the job")
    options = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if bool(command) == options.check:
        parser.error("give a command after -- (or --check alone)")
    return options, command


def main(argv: list[str] | None = None) -> int:
    options, command = _parse(sys.argv[1:] if argv is None else argv)
    ranks = options.ranks or torchrun_ranks(command) or (2 if options.check else None)
    previous = {signum: signal.signal(signum, _interrupt) for signum in _SIGNALS}
    try:
        if ranks is None:
            raise NetemError("give --ranks (or a torchrun command with --nproc-per-node N)")
        if options.check and ranks < 2:
            raise NetemError("--check needs 2 ranks")
        with links(ranks, options.rate, options.delay) as topology:
            print(f"distlion-netem: {ranks} ranks, links of {topology.rate or 'uncapped rate'}"
                  f"{f', {topology.delay} one-way delay' if topology.delay else ''}, in namespaces "
                  f"{topology.name}-r*", flush=True)
            measured = None
            if options.check or (not options.no_check and ranks >= 2):
                measured = check_link(topology)
            return run_ranks(rank_commands(command, topology, options.master_port, measured)) if command else 0
    except NetemError as error:
        print(f"distlion-netem: error: {error}", file=sys.stderr)
        return 2
    except _Interrupted as stop:
        print(f"distlion-netem: stopped by {signal.Signals(stop.signum).name}; ranks ended, namespaces removed",
              file=sys.stderr)
        return 128 + stop.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
