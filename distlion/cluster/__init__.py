"""Cluster backends: where workers run and how their messages reach the server.

A backend takes the local workers' flat gradients for a step, runs the method's rules and applies
the result, and returns the bits it moved (`StepBits`). `local_workers` says which workers' gradients
this process computes: all of them in the simulated cluster, its own rank under torch.distributed.
"""

from __future__ import annotations

from typing import Any

from distlion.cluster.simulated import SimulatedCluster, StepBits
from distlion.flat import FlatParams
from distlion.methods.base import Method

BACKENDS = ("simulated", "torchdist")


def build_cluster(cfg: Any, method: Method, flat: FlatParams, seed: int):
    """The backend named by `cluster.backend`."""
    if cfg.backend == "simulated":
        return SimulatedCluster(method, flat, cfg.workers, seed=seed)
    if cfg.backend == "torchdist":
        # Imported here: torch.distributed is only touched by runs that ask for it.
        from distlion.cluster.torchdist import TorchDistCluster

        return TorchDistCluster(method, flat, cfg.workers, seed=seed, dist_backend=cfg.dist_backend,
                                timeout_s=cfg.timeout_s)
    raise ValueError(f"cluster.backend={cfg.backend!r} is unknown; choose one of {BACKENDS}")


__all__ = ["BACKENDS", "SimulatedCluster", "StepBits", "build_cluster"]
