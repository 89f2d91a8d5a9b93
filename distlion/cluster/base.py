"""The cluster contract: a `Backend` (where workers run, how their messages meet, who writes results)
and the `Cluster` that steps a method over it with the one step loop of `distlion.methods.step`.

The backend is an `Exchanger` (`distlion.comm.exchange`) plus what a training run needs around
the step: the mean train loss over all workers, the wire bytes moved, a check before the first step,
which process writes results, and the name of this process's checkpoint file.
"""

from __future__ import annotations

import copy
import functools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from distlion.cluster.grads import WorkerGrads, worker_grads
from distlion.comm.collectives import WireBytes
from distlion.comm.exchange import ServerRule
from distlion.comm.faults import Faults, FaultSpec
from distlion.comm.message import Message
from distlion.flat import LOW_PRECISION, FlatParams
from distlion.methods.base import Method, StepContext
from distlion.methods.step import BufferWorkers, StepBits, algorithm1_step


@dataclass
class BitsTally:
    """A run's bits so far, in the two totals the results report:

    cum_bits_per_param  bits one (average) worker sent and received, per parameter, summed over steps:
                        the paper's x-axis (divided by the steps: bits per parameter per iteration)
    total_bits          every bit that crossed the network, all N workers together
    """

    num_params: int
    up: float = 0.0
    """Uplink bits of the average worker, summed over steps."""
    down: int = 0
    """Downlink bits each worker received, summed over steps."""
    cum_bits_per_param: float = 0.0
    total_bits: int = 0
    wire_bytes: int | None = None
    """Bytes this process's collectives moved (torch.distributed only)."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite gradient (they send nothing)."""

    def add(self, bits: StepBits) -> dict[str, float]:
        """Count one step; returns its metrics line fields."""
        self.skipped_steps += bits.skipped
        self.up += bits.mean_up
        self.down += bits.down
        self.cum_bits_per_param += bits.per_worker / self.num_params
        self.total_bits += bits.total
        record = {
            "bits_up_per_param": bits.mean_up / self.num_params,
            "bits_down_per_param": bits.down / self.num_params,
            "cum_bits_per_param": self.cum_bits_per_param,
            "total_bits": self.total_bits,
            "skipped_steps": self.skipped_steps,
        }
        if bits.wire is not None:
            self.wire_bytes = (self.wire_bytes or 0) + bits.wire.total
            record["wire_bytes"] = bits.wire.total
        return record

    def summary(self, steps: int) -> dict[str, float]:
        """Per-iteration averages and totals of a finished run of `steps` steps."""
        out = {
            "bits_up_per_param_per_iter": self.up / steps / self.num_params,
            "bits_down_per_param_per_iter": self.down / steps / self.num_params,
            "bits_per_param_per_iter": self.cum_bits_per_param / steps,
            "cum_bits_per_param": self.cum_bits_per_param,
            "total_bits": self.total_bits,
            "skipped_steps": self.skipped_steps,
        }
        if self.wire_bytes is not None:
            out["wire_bytes_per_step"] = self.wire_bytes / steps
        return out


class ReplicaGradients:
    """Each local worker's gradient at its own replica: the replica copied into the model, then that worker's rows
    through the configured strategy as a cluster of one (what a rank computes under torch.distributed)."""

    def __init__(self, compute: Callable[..., WorkerGrads], replicas: dict[torch.dtype, torch.Tensor]):
        self.compute = compute
        self.replicas = replicas

    def __call__(self, model: torch.nn.Module, flat: FlatParams, per_example_loss: Callable, inputs: torch.Tensor,
                 targets: torch.Tensor, num_workers: int) -> WorkerGrads:
        grads = {d: torch.empty(num_workers, b.numel(), dtype=d, device=b.device) for d, b in flat.buffers.items()}
        losses = torch.empty(num_workers, device=flat.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(num_workers), targets.chunk(num_workers), strict=True)):
            for dtype, replicas in self.replicas.items():
                flat.buffers[dtype].copy_(replicas[i])
            worker, loss = self.compute(model, flat, per_example_loss, x, y, 1)
            for dtype, g in worker.items():
                grads[dtype][i] = g[0]
            losses[i] = loss[0]
        return grads, losses


def check_workers(num_workers: Any) -> int:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"cluster.workers={num_workers!r} must be >= 1, a whole number of workers")
    return num_workers


class Backend(ABC):
    """Where workers run and how their messages meet (an `Exchanger`), and who writes results.

    `num_workers` is N; `local_workers` the workers whose gradients, states and rules this process
    runs (all N in one process, its own rank under torch.distributed); `is_main` whether this process
    logs and writes results; `shard_suffix` names this process's checkpoint file.
    """

    num_workers: int
    local_workers: list[int]
    is_main: bool = True
    shard_suffix: str = ""

    @abstractmethod
    def exchange(self, how: str, server_rule: ServerRule, messages: list[Message]) -> tuple[Message, list[int]]:
        """The `Exchanger` contract: the local workers' uplinks -> (the downlink, uplink bits of all N)."""

    @abstractmethod
    def mean_loss(self, losses: torch.Tensor) -> float:
        """Mean train loss over all N workers, given the local workers' losses."""

    @property
    def wire(self) -> WireBytes | None:
        """Bytes this process's collectives moved so far (None without collectives)."""
        return None

    def agree_start(self, step: int) -> int:
        """The step every process resumes at, given the step of this process's checkpoint: the earliest."""
        return step

    def gather_uncounted(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's `tensor` in worker order, outside the counted traffic (to evaluate a model made of the
        workers' replicas); in one process, the tensor itself."""
        return [tensor]


class Cluster:
    """A method bound to each flat buffer (one per dtype) of the model, run by a backend.

    The local workers share one parameter copy (`flat`); each keeps its own worker state.
    `nonfinite` is the policy for a NaN/inf gradient (see `algorithm1_step`). With `master_weights`,
    a bf16/fp16 buffer gets an fp32 master copy that the method is bound to and steps (its worker
    state is fp32 too); the model's buffer is the master rounded after every step. Without it, a
    Lion-type update of 1e-4 on a bf16 weight near 1 is below the rounding step and lost. `faults`
    makes the last k workers faulty (`distlion.comm.faults`).
    """

    def __init__(self, method: Method, flat: FlatParams, backend: Backend, seed: int = 0, nonfinite: str = "error",
                 master_weights: bool = False, faults: FaultSpec | None = None):
        self.flat = flat
        self.backend = backend
        self.seed = seed
        self.nonfinite = nonfinite
        self.faults = Faults(faults or FaultSpec(), backend.num_workers, seed)
        self.faults.check(method.name, method.exchange)
        self.buffers: dict[torch.dtype, BufferWorkers] = {}
        self.masters: dict[torch.dtype, torch.Tensor] = {}
        # A method with replicas (local updates) run by several workers in this process: a parameter copy each,
        # [local, numel] per buffer. One worker per process steps the model's own buffer.
        self.replicas: dict[torch.dtype, torch.Tensor] = {}
        if method.replicas and master_weights and any(d in LOW_PRECISION for d in flat.buffers):
            raise ValueError(f"method={method.name} keeps a replica per worker; run it in fp32 (train.dtype=float32)")
        for dtype, buffer in flat.buffers.items():
            if dtype in LOW_PRECISION and master_weights:
                buffer = self.masters.setdefault(dtype, buffer.to(torch.float32))
            elif dtype in LOW_PRECISION:
                warnings.warn(f"{dtype} parameters lose updates below their rounding step (an lr of 1e-4 on a "
                              "weight near 1 in bf16 is lost every step); keep fp32 master weights "
                              "(train.master_weights=true)", stacklevel=2)
            local = backend.local_workers
            if method.replicas and len(local) > 1:
                copies = self.replicas[dtype] = buffer.detach().unsqueeze(0).repeat(len(local), 1)
                bound = [copy.deepcopy(method).bind(row, backend.num_workers, flat.layouts[dtype]) for row in copies]
                self.buffers[dtype] = BufferWorkers(bound, [m.init_worker_state() for m in bound])
                continue
            shared = copy.deepcopy(method).bind(buffer, backend.num_workers, flat.layouts[dtype])
            self.buffers[dtype] = BufferWorkers([shared] * len(local), [shared.init_worker_state() for _ in local])

    @property
    def num_workers(self) -> int:
        return self.backend.num_workers

    @property
    def local_workers(self) -> list[int]:
        return self.backend.local_workers

    @property
    def is_main(self) -> bool:
        return self.backend.is_main

    @property
    def exchanges_in_backward(self) -> bool:
        """Whether the method's exchange runs inside backward (DDP's comm hooks)."""
        return any(m.exchange == "in_backward" for m in self.methods.values())

    @property
    def methods(self) -> dict[torch.dtype, Method]:
        """The method instance bound to each buffer's (shared) parameters."""
        return {dtype: local.methods[0] for dtype, local in self.buffers.items()}

    @property
    def worker_states(self) -> dict[torch.dtype, list[dict[str, torch.Tensor]]]:
        """Each local worker's state, per buffer."""
        return {dtype: local.states for dtype, local in self.buffers.items()}

    def step(self, grads: dict[torch.dtype, torch.Tensor], step: int, lr: float, epoch: float = 0.0,
             diagnose: bool = False, final_sync: bool = False, nonfinite: str | None = None) -> StepBits:
        """Apply one step given the local workers' flat gradients ({dtype: [local, numel]}). `diagnose`: keep what
        was exchanged, for `diagnostics`; `final_sync`: the run's last step, where a local-update method syncs too;
        `nonfinite`: this step's policy, if not the cluster's (fp16's loss scale skips overflowed steps)."""
        before = self.backend.wire
        ctx = StepContext(step=step, lr=lr, num_workers=self.num_workers, epoch=epoch, seed=self.seed,
                          final_sync=final_sync)
        grads = {d: g.to(torch.float32) if d in self.masters else g for d, g in grads.items()}
        bits = algorithm1_step(self.buffers, grads, ctx, self.backend, nonfinite or self.nonfinite,
                               self.faults if self.faults.faulty else None, diagnose)
        for dtype, master in self.masters.items():
            self.flat.buffers[dtype].copy_(master)
        if before is not None and not self.exchanges_in_backward:
            bits.wire = self.backend.wire - before  # (DDP's hooks move bytes outside these collectives)
        return bits

    def diagnostics(self, bits: StepBits) -> dict[str, Any]:
        """What a sign method's vote says of itself at a step run with `diagnose` (`DLion.vote_diagnostics`), as the
        metrics logged: `vote_agreement`, the fraction of the workers' signs equal to the voted sign (summed over
        processes, outside the counted traffic), and `vote_margins`, the fraction of coordinates at each
        |sum of signs| / N = 0, 1/N, ..., 1 where the counts are here (the Avg downlink everywhere; MaVo in one
        process). Every process calls it at the same steps; empty for other methods."""
        counts: dict[str, torch.Tensor] = {}
        for dtype, (sent, reply) in bits.exchanged.items():
            method = self.methods[dtype]
            for key, value in method.vote_diagnostics(sent, reply, self.num_workers).items():
                counts[key] = counts[key] + value if key in counts else value
        if not counts:
            return {}
        agree2, signs = (sum(self.backend.gather_uncounted(counts[k].reshape(1).to(torch.int64))).item()
                         for k in ("agree2", "signs"))
        out: dict[str, Any] = {"vote_agreement": agree2 / (2 * signs)}
        if "margins" in counts:
            margins = counts["margins"].to(torch.float64)
            out["vote_margins"] = (margins / margins.sum()).tolist()
        return out

    def mean_loss(self, losses: torch.Tensor) -> float:
        return self.backend.mean_loss(losses)

    def gradients(self, model: torch.nn.Module, strategy: str) -> Callable[..., WorkerGrads]:
        """The function that computes the local workers' gradients (`distlion.cluster.grads`); with replicas, each
        worker's at its own parameters."""
        if self.replicas:
            return ReplicaGradients(worker_grads(strategy), self.replicas)
        return worker_grads(strategy)

    @property
    def has_replicas(self) -> bool:
        """Whether the workers' parameters differ between exchanges (a local-update method)."""
        return any(m.replicas for m in self.methods.values())

    def counted(self, workers: list[dict[torch.dtype, torch.Tensor]] | None = None) -> dict[torch.dtype, torch.Tensor]:
        """The parameters that count, per buffer (`Method.counted_params`): for a method with replicas, the ones
        evaluated and saved (LocalSGD: the workers' mean; DiLoCo: the global parameters); else the model's.
        `workers`: every worker's parameters when the caller has them already (`worker_params`), else gathered."""
        if not self.has_replicas:
            return dict(self.flat.buffers)

        def replicas(dtype: torch.dtype) -> list[torch.Tensor]:
            return [w[dtype] for w in workers] if workers is not None else self._all_replicas(dtype)

        return {dtype: local.methods[0].counted_params(functools.partial(replicas, dtype))
                for dtype, local in self.buffers.items()}

    def _all_replicas(self, dtype: torch.dtype) -> list[torch.Tensor]:
        if dtype in self.replicas:
            return list(self.replicas[dtype])
        return self.backend.gather_uncounted(self.flat.buffers[dtype])

    def worker_params(self) -> list[dict[torch.dtype, torch.Tensor]]:
        """Every worker's own parameters, in worker order (every process calls it: under torchrun they are gathered,
        outside the counted traffic). For the diagnostics of local-update methods: drift, local models."""
        per_buffer = {dtype: self._all_replicas(dtype) for dtype in self.buffers}
        return [{dtype: replicas[i] for dtype, replicas in per_buffer.items()} for i in range(self.num_workers)]

    @contextmanager
    def counted_params(self, workers: list[dict[torch.dtype, torch.Tensor]] | None = None) -> Iterator[None]:
        """The model holds the parameters that count inside the block (every process enters it: with replicas
        across processes they are gathered, unless `workers` has them), its own parameters again after it."""
        if not self.has_replicas:
            yield
            return
        counted = self.counted(workers)
        own = {d: b.clone() for d, b in self.flat.buffers.items()}
        for dtype, values in counted.items():
            self.flat.buffers[dtype].copy_(values)
        try:
            yield
        finally:
            for dtype, values in own.items():
                self.flat.buffers[dtype].copy_(values)

    def finish(self) -> None:
        """The model takes the parameters that count and keeps them: at the end of a run (what is digested and
        saved), or after each step driven with explicit gradients (`distlion.Simulation`)."""
        if self.has_replicas:
            for dtype, values in self.counted().items():
                self.flat.buffers[dtype].copy_(values)

    def state_bytes(self) -> int:
        """Bytes this process holds beyond the model: replicas, the workers' states and the methods' (the inner and
        outer optimizers of local-update methods), each counted once."""
        seen: dict[int, int] = {}

        def visit(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                seen.setdefault(id(value), value.numel() * value.element_size())
            elif isinstance(value, dict):
                for v in value.values():
                    visit(v)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    visit(v)

        states = [m.state_dict() for local in self.buffers.values() for m in local.appliers]  # alive while counted
        for local in self.buffers.values():
            visit(local.states)
        visit(states)
        visit(self.replicas)
        visit(self.masters)
        return sum(seen.values())

    def state_dict(self) -> dict[str, Any]:
        """The replicated method state and the local workers' own states."""
        return {
            "workers": self.num_workers,
            "local_workers": list(self.local_workers),
            "methods": {str(d): m.state_dict() for d, m in self.methods.items()},
            "worker_states": {str(d): local.states for d, local in self.buffers.items()},
            "masters": {str(d): m for d, m in self.masters.items()},
            "faults": self.faults.state_dict(),
            # Per worker in this process, when each has its own parameters and method state.
            "replicas": {str(d): r for d, r in self.replicas.items()},
            "replica_methods": {str(d): [m.state_dict() for m in local.appliers] for d, local in self.buffers.items()
                                if d in self.replicas},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state.get("workers"), state.get("local_workers"))
        if saved != (self.num_workers, list(self.local_workers)):
            raise ValueError(
                f"the checkpoint holds workers {saved[1]} of {saved[0]}, this process runs workers "
                f"{self.local_workers} of {self.num_workers}; resume with the same cluster.workers and ranks"
            )
        for dtype, local in self.buffers.items():
            if dtype in self.replicas:
                self.replicas[dtype].copy_(state["replicas"][str(dtype)])
                for method, saved in zip(local.appliers, state["replica_methods"][str(dtype)], strict=True):
                    method.load_state_dict(saved)
            else:
                for method in local.appliers:
                    method.load_state_dict(state["methods"][str(dtype)])
            local.states[:] = state["worker_states"][str(dtype)]
        for dtype, master in self.masters.items():
            master.copy_(state["masters"][str(dtype)])
        self.faults.load_state_dict(state.get("faults", {}))
