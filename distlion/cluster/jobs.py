"""Runs as cluster jobs through Hydra's submitit launcher (`hydra/launcher=submitit_slurm` or `submitit_local`).

Each grid point of a sweep is one job. A `cluster=torchdist` run is a job of `cluster.nodes` x
`cluster.tasks_per_node` tasks, one rank each: `JobShape` copies that shape (and `cluster.gpus_per_node`)
from the cluster config into the launcher's before it submits, and each task joins the process group
from the job's environment (SLURM's, or the local executor's) as a torchrun rank would from torchrun's.
What holds under torchrun holds here: a finished run is skipped when it is submitted again, and a job that
is preempted or hits its time limit is requeued by submitit (`hydra.launcher.max_num_timeout` times for
time limits) and resumes from the run's last checkpoint to the same final parameters.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict

SHAPE = ("nodes", "tasks_per_node", "gpus_per_node")


def under_submitit() -> bool:
    """Whether this process is a task of a submitit job (SLURM or local)."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


class JobShape(Callback):
    """Before a multirun launches: a submitit launcher gets the job shape of a `cluster=torchdist` run."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher, cluster = config.hydra.launcher, config.get("cluster", {})
        if "submitit" not in str(launcher.get("_target_", "")) or cluster.get("backend") != "torchdist":
            return
        with open_dict(launcher):
            for key in SHAPE:
                launcher[key] = cluster.get(key) or None  # no GPUs: no --gpus-per-node at all


def export_rank_environment(cluster: DictConfig) -> None:
    """In a task of a submitit job, export what torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    LOCAL_RANK) from the job's environment, before `cluster.workers` (the WORLD_SIZE by default) is read.
    The job must have the shape the config asks for: a sweep over the shape would run every point with the
    first point's, so it is refused."""
    if not under_submitit() or "RANK" in os.environ:
        return
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    job = JobEnvironment()
    wanted = int(cluster.get("nodes", 1)) * int(cluster.get("tasks_per_node", 1))
    if job.num_tasks != wanted:
        raise ValueError(
            f"this submitit job has {job.num_tasks} tasks but cluster.nodes x cluster.tasks_per_node = {wanted}; "
            "a launcher submits every point of a sweep with one shape: sweep the shape in separate commands"
        )
    # With GPUs, each task sees its own as cuda:0 (as torchrun jobs pin LOCAL_RANK's).
    TorchDistributedEnvironment().export(set_cuda_visible_devices=bool(cluster.get("gpus_per_node")))


class Preemption:
    """Under a submitit job, preemption or the time limit is announced by a signal (USR2), which submitit's
    handler answers by requeueing from global rank 0 at once. Here the signal only sets a flag; at the end of each
    step the ranks agree whether any of them got it (a max all-reduce of one int, outside the counted collectives:
    bits and wire bytes stay the run's), all write their checkpoints at that step, and submitit's handler then
    requeues the job. Without the agreement rank 0 would leave mid-step and end the others' collectives with an
    error. Outside a submitit job this does nothing."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.active = under_submitit()
        self.device = device  # of the flag's all-reduce (CUDA for NCCL)
        self.noticed = False
        if self.active:
            from submitit import JobEnvironment

            self.signum = JobEnvironment._usr_sig()
            self.handler = signal.getsignal(self.signum)
            signal.signal(self.signum, self._notice)

    def _notice(self, signum: int, frame: Any) -> None:
        self.noticed = True

    def agreed(self) -> bool:
        """Whether any rank got the signal (every rank calls this at the same step)."""
        if not self.active:
            return False
        flag = torch.tensor([int(self.noticed)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def requeue(self) -> None:
        """Hand over to submitit's handler (rank 0 checkpoints the job and requeues it), then leave."""
        signal.signal(self.signum, self.handler)
        if callable(self.handler):
            self.handler(self.signum, None)
        print("distlion: preempted; the requeued job resumes from this step's checkpoint", file=sys.stderr)
        sys.exit(-1)
