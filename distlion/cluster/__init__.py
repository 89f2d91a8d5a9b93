"""Cluster backends: where workers run and how their messages reach the server.

Both backends run the one step loop of `distlion.methods.step` (Algorithm 1 of the paper) through
`distlion.cluster.base.Cluster` and differ only in their `Backend`: all N workers in this process
(`simulated`), or one worker per torchrun rank (`torchdist`).
"""

from __future__ import annotations

from typing import Any

from distlion.cluster.base import Backend, BitsTally, Cluster
from distlion.cluster.simulated import SimulatedCluster
from distlion.cluster.torchdist import TorchDistCluster
from distlion.comm.faults import FaultSpec
from distlion.flat import FlatParams
from distlion.methods.base import Method

BACKENDS = ("simulated", "torchdist")


def build_cluster(cfg: Any, method: Method, flat: FlatParams, seed: int, nonfinite: str = "error",
                  master_weights: bool = False) -> Cluster:
    """The backend named by `cluster.backend` (see `Cluster` for `nonfinite` and `master_weights`)."""
    options = {"seed": seed, "nonfinite": nonfinite, "master_weights": master_weights,
               "faults": FaultSpec.from_config(cfg)}
    if cfg.backend == "simulated":
        return SimulatedCluster(method, flat, cfg.workers, **options)
    if cfg.backend == "torchdist":
        return TorchDistCluster(method, flat, cfg.workers, dist_backend=cfg.get("dist_backend", "auto"),
                                timeout_s=cfg.timeout_s,
                                **options)
    raise ValueError(f"cluster.backend={cfg.backend!r} is unknown; choose one of {BACKENDS}")


__all__ = ["BACKENDS", "Backend", "BitsTally", "Cluster", "SimulatedCluster", "TorchDistCluster", "build_cluster"]
