"""One worker per torchrun rank: the cluster backend over torch.distributed (gloo on the CPU, NCCL on GPUs).

    torchrun --nproc-per-node 4 -m distlion.train cluster=torchdist task=digits method=dlion

Rank r is worker r of Algorithm 1: it computes the gradient of its own batch, keeps its own worker
state (Lion momentum never leaves the rank), and holds the same parameters as every other rank.
No rank is the server: the server rule runs where the method's `exchange` says it can, through the
exchanges of `distlion.comm.exchange` over the counted collectives of `distlion.comm.collectives`.
A step's bits are the nominal bits of the messages, the same numbers the simulated cluster counts,
plus the wire bytes this rank's collectives moved (`StepBits.wire`).
"""

from __future__ import annotations

import atexit
import datetime
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from distlion.cluster.base import Backend, Cluster, check_workers
from distlion.cluster.ddp import DDPGradients
from distlion.cluster.grads import WorkerGrads
from distlion.comm.collectives import Collectives, WireBytes
from distlion.comm.exchange import CollectiveExchange
from distlion.comm.faults import FaultSpec
from distlion.device import resolve_dist_backend
from distlion.flat import FlatParams
from distlion.methods.base import Method


def init_process_group(dist_backend: str, timeout_s: float, workers: int,
                       device: torch.device | None = None) -> bool:
    """Join the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), with a timeout on every collective; returns whether this call created it.

    An already initialized group is reused (several runs in one process). Without torchrun's
    variables a world of one is made in memory. On a GPU (`device`) the group is bound to it, so NCCL
    connects eagerly on the rank's own GPU.
    """
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        bound = {"device_id": device} if device is not None and device.type == "cuda" else {}
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            # torchrun's agent serves one store across `--max-restarts` attempts, so a restarted rank could
            # read the dead group's gloo addresses and fail to connect (torch 2.14.1): a prefix per attempt.
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
            store = dist.PrefixStore(f"distlion/attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
            dist.init_process_group(dist_backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                    **bound)
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(dist_backend, timeout=timeout, **bound)
        elif workers == 1:
            store = dist.HashStore()
            dist.init_process_group(dist_backend, store=store, rank=0, world_size=1, timeout=timeout, **bound)
        else:
            raise ValueError(
                f"cluster.backend=torchdist runs one process per worker; launch cluster.workers={workers} of "
                f"them with `torchrun --nproc-per-node {workers} -m distlion.train cluster=torchdist ...`"
            )
        created = True
    else:
        created = False
    if dist.get_world_size() != workers:
        size = dist.get_world_size()
        if created:
            dist.destroy_process_group()
        raise ValueError(
            f"cluster.workers={workers} but torchrun started {size} ranks; set cluster.workers={size} "
            "(its default is the WORLD_SIZE that torchrun sets)"
        )
    return created


class Heartbeat:
    """A counter each rank's daemon thread advances in the group's store every `interval_s` seconds. A rank that
    stops (SIGSTOP, a frozen node) stops advancing it while a rank merely slow keeps it going, so when a collective
    times out the ranks still waiting can name the one that stopped answering (torchrun itself names the rank that
    exits, which is one of the waiting ones). The store is torchrun's agent's, alive whichever rank stops."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval_s: float = 0.5):
        self.store, self.rank, self.world_size, self.interval_s = store, rank, world_size, interval_s
        self.store.add(self._key(rank), 1)
        threading.Thread(target=self._beat, name="distlion-heartbeat", daemon=True).start()

    @staticmethod
    def _key(rank: int) -> str:
        return f"distlion/heartbeat/{rank}"

    def _beat(self) -> None:
        while True:
            time.sleep(self.interval_s)
            try:
                self.store.add(self._key(self.rank), 1)
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): nothing left to tell
                return

    def stopped(self) -> list[int]:
        """The other ranks whose counter did not advance over 6 beats."""
        try:
            before = [self.store.add(self._key(r), 0) for r in range(self.world_size)]
            time.sleep(6 * self.interval_s)
            after = [self.store.add(self._key(r), 0) for r in range(self.world_size)]
        except Exception:  # noqa: BLE001 - no store to ask: the caller says what it knows without it
            return []
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]

    def describe(self) -> str:
        stopped = self.stopped()
        if not stopped:
            return ""
        ranks = ", ".join(map(str, stopped))
        return (f"rank{'s' if len(stopped) > 1 else ''} {ranks} stopped answering (no heartbeat for "
                f"{6 * self.interval_s:g} s: stopped, e.g. by SIGSTOP, or frozen)")


_HEARTBEATS: dict[int, Heartbeat] = {}


def heartbeat(rank: int, world_size: int) -> Heartbeat:
    """This process's heartbeat in the default group's store: one per group, however many runs use the group."""
    store = dist.distributed_c10d._get_default_store()
    if id(store) not in _HEARTBEATS:
        _HEARTBEATS[id(store)] = Heartbeat(store, rank, world_size)
    return _HEARTBEATS[id(store)]


class TorchDistBackend(CollectiveExchange, Backend):
    """This rank's worker; the server rule distributed over the ranks."""

    def __init__(self, num_workers: int, dist_backend: str = "auto", timeout_s: float = 300.0,
                 device: torch.device | str = "cpu"):
        check_workers(num_workers)
        if not timeout_s > 0:
            raise ValueError(f"cluster.timeout_s={timeout_s} must be > 0")
        device = torch.device(device)
        if init_process_group(resolve_dist_backend(dist_backend, device), timeout_s, num_workers, device):
            # Destroyed at exit rather than per run: a Hydra multirun reuses the group run after run.
            atexit.register(_destroy_process_group)
        super().__init__(Collectives(timeout=datetime.timedelta(seconds=timeout_s), device=device))
        if self.comm.world_size > 1:
            self.comm.diagnose = heartbeat(self.comm.rank, self.comm.world_size).describe
        self.rank = self.comm.rank
        self.is_main = self.rank == 0
        self.shard_suffix = f".rank{self.rank}"

    def mean_loss(self, losses: torch.Tensor) -> float:
        """The N ranks' losses gathered in rank order, then averaged (the simulated cluster's float ops)."""
        return self.comm.all_gather(losses.reshape(-1)).reshape(-1).mean().item()

    @property
    def wire(self) -> WireBytes:
        return self.comm.wire

    def gather_uncounted(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        with self.comm.uncounted():
            return list(self.comm.all_gather(tensor))

    def agree_start(self, step: int) -> int:
        """Ranks killed at different moments hold checkpoints of different steps: all resume at the earliest."""
        mine = torch.tensor([step], dtype=torch.int64, device=self.comm.device)
        return min(self.comm.all_gather(mine).view(-1).tolist())


class TorchDistCluster(Cluster):
    """This rank's worker of `num_workers`, on its copy of the parameters."""

    def __init__(
        self,
        method: Method,
        flat: FlatParams,
        num_workers: int,
        seed: int = 0,
        dist_backend: str = "auto",
        timeout_s: float = 300.0,
        nonfinite: str = "error",
        master_weights: bool = False,
        faults: FaultSpec | None = None,
    ):
        backend = TorchDistBackend(num_workers, dist_backend, timeout_s, flat.device)
        super().__init__(method, flat, backend, seed, nonfinite, master_weights, faults)

    def gradients(self, model: torch.nn.Module, strategy: str) -> Callable[..., WorkerGrads]:
        """A method that exchanges in backward gets its gradient through DDP and its comm hook."""
        (method,) = self.methods.values() if len(self.methods) == 1 else (None,)
        if method is not None and method.exchange == "in_backward":
            return DDPGradients(model, self.flat, method, self.seed)
        return super().gradients(model, strategy)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
