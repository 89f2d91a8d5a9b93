"""N workers in one process: one model replica, N worker states, one server.

Every worker applies the same downlink message to the same parameters, so a single shared copy of x
is exact; only what differs by worker (its gradient and its state, e.g. Lion momentum) is kept N
times. The server rule runs on the N messages themselves, whatever exchange the method names.
"""

from __future__ import annotations

import torch

from distlion.cluster.base import Backend, Cluster, check_workers
from distlion.comm.exchange import InProcessExchange
from distlion.comm.faults import FaultSpec
from distlion.flat import FlatParams
from distlion.methods.base import Method


class SimulatedBackend(InProcessExchange, Backend):
    """All N workers in this process; the server sees their messages directly."""

    def __init__(self, num_workers: int):
        super().__init__(check_workers(num_workers))

    def mean_loss(self, losses: torch.Tensor) -> float:
        return losses.mean().item()


class SimulatedCluster(Cluster):
    """`num_workers` simulated workers on one shared parameter copy."""

    def __init__(self, method: Method, flat: FlatParams, num_workers: int, seed: int = 0, nonfinite: str = "error",
                 master_weights: bool = False, faults: FaultSpec | None = None):
        super().__init__(method, flat, SimulatedBackend(num_workers), seed, nonfinite, master_weights, faults)
