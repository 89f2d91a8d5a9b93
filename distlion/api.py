"""Drive any method step by step with explicit per-worker gradients.

For checking the implementation against the paper's equations by hand:

    >>> import torch
    >>> from distlion import Simulation
    >>> sim = Simulation("dlion", [torch.zeros(3)], num_workers=2, lr=0.1, aggregation="mavo")
    >>> out = sim.step([[torch.tensor([1.0, -2.0, 3.0])], [torch.tensor([2.0, -1.0, -3.0])]])
    >>> out.params[0]          # Delta = sign(sum of signs) = [+1, -1, tie -> +1 at step 0, even index]
    tensor([-0.1000,  0.1000, -0.1000])
    >>> out.bits_up, out.bits_down   # 3 signs pack into one byte each way
    ([8, 8], 8)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from distlion.cluster.simulated import SimulatedCluster
from distlion.flat import FlatParams
from distlion.methods import Method, build_method
from distlion.methods.base import check_lr


@dataclass
class StepResult:
    params: list[torch.Tensor]
    """The parameters after the step (views into the simulation's flat buffer)."""
    worker_states: list[dict[str, torch.Tensor]]
    """Each worker's state after the step (for `dlion`, its momentum), as flat tensors."""
    bits_up: list[int]
    """Uplink bits each worker sent, counted from its message."""
    bits_down: int
    """Downlink bits each worker received, counted from the server's message."""
    skipped: bool = False
    """The step was skipped for a non-finite gradient (`nonfinite="skip"`)."""


class Simulation:
    """A method bound to copies of `params`, run for `num_workers` simulated workers.

    `method` is a registry name (hyperparameters as keyword arguments) or a built `Method`.
    `nonfinite` is what a NaN/inf gradient does: "error" (raise) or "skip" (the step);
    `master_weights` keeps an fp32 copy of bf16/fp16 parameters (see `distlion.cluster.Cluster`).
    """

    def __init__(self, method: str | Method, params: list[torch.Tensor], num_workers: int, seed: int = 0,
                 nonfinite: str = "error", master_weights: bool = False, **hparams):
        self.method = build_method(method, **hparams) if isinstance(method, str) else method
        self._module = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in params])
        self.flat = FlatParams(self._module)
        if len(self.flat.dtypes) != 1:
            raise ValueError("Simulation takes parameters of a single dtype")
        self.cluster = SimulatedCluster(self.method, self.flat, num_workers, seed, nonfinite, master_weights)
        self.num_steps = 0

    @property
    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self._module]

    def step(self, worker_grads: list[list[torch.Tensor]], lr: float | None = None, epoch: float = 0.0,
             final_sync: bool = False) -> StepResult:
        """One step: `worker_grads[i]` holds worker i's gradient for each parameter, in order. `final_sync`: the
        last step, where a local-update method syncs whatever its H (as `train.final_sync` does in a run)."""
        if len(worker_grads) != self.cluster.num_workers:
            raise ValueError(f"got gradients of {len(worker_grads)} workers, expected {self.cluster.num_workers}")
        for worker, per_worker in enumerate(worker_grads):
            self._check_grads(worker, per_worker)
        if lr is not None:
            check_lr(lr, "step(lr=...)")
        (dtype,) = self.flat.dtypes
        grads = torch.stack([torch.cat([g.reshape(-1) for g in per_worker]) for per_worker in worker_grads])
        lr = self.method.lr if lr is None else lr
        bits = self.cluster.step({dtype: grads}, step=self.num_steps, lr=lr, epoch=epoch, final_sync=final_sync)
        self.cluster.finish()  # local-update methods: `params` are the ones that count (e.g. the workers' mean)
        self.num_steps += 1
        return StepResult(self.params, self.cluster.worker_states[dtype], bits.up, bits.down, bits.skipped)

    def _check_grads(self, worker: int, grads: list[torch.Tensor]) -> None:
        """One gradient per parameter, in order, of its exact shape and dtype (no broadcasting, no reshaping)."""
        params = self.params
        if len(grads) != len(params):
            raise ValueError(f"worker {worker} gave {len(grads)} gradients for {len(params)} parameters")
        for i, (g, p) in enumerate(zip(grads, params, strict=True)):
            if g.shape != p.shape or g.dtype != p.dtype:
                raise ValueError(f"worker {worker}'s gradient {i} is {g.dtype} {tuple(g.shape)}, but parameter {i} "
                                 f"is {p.dtype} {tuple(p.shape)}")
