"""Gradients through `DistributedDataParallel`, for the methods whose exchange runs in backward
(`distlion.methods.ddp`, and D-Lion's own hook in `distlion.methods.dlion_ddp`): DDP exchanges each bucket
from its comm hook as soon as the bucket's gradients are ready, so communication overlaps the rest of
backward, as in every DDP job.

Each rank is one worker. The hook's all-reduces are logged (`PayloadLog`, for the bits) and timed:
`comm` is the time from each bucket's hook call to its result (the union over buckets, the hook's
own compression included), `comm_exposed` the part after the last bucket was ready (backward's
compute was over and the step waited for the network), `comm_hidden` the rest, overlapped with compute.
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distlion.cluster.grads import LossFn, WorkerGrads
from distlion.flat import FlatParams
from distlion.methods.base import Method
from distlion.methods.ddp import DDPMethod, PayloadLog

# torch 2.14 renamed `broadcast_buffers` (deprecated) to `forward_sync_buffers`.
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                   else {"broadcast_buffers": False})


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def in_bucket_order(hook: Any) -> Any:
    """`hook`, run for one bucket at a time, in the order DDP hands them over, on a thread of its own.

    torch's PowerSGD hook issues its later all-reduces from future callbacks, so on gloo a rank may
    interleave bucket k's second all-reduce with bucket k+1's first while another rank does not, and
    gloo pairs the mismatched messages ("Received data size doesn't match expected size", seen with
    llama_10m's 2 buckets). One thread per rank running the buckets in turn gives every rank the same
    order; backward still runs meanwhile, so communication still overlaps it.
    """
    jobs: queue.Queue = queue.Queue()

    def serve() -> None:
        while True:
            state, bucket, future = jobs.get()
            try:
                future.set_result(hook(state, bucket).wait())
            except Exception as err:  # noqa: BLE001 - the failure reaches DDP through the future
                future.set_exception(err)

    threading.Thread(target=serve, name="ddp-hook-in-order", daemon=True).start()

    def ordered_hook(state, bucket):  # no annotations: DDP checks them against its own types
        future: torch.futures.Future = torch.futures.Future()
        jobs.put((state, bucket, future))
        return future

    return ordered_hook


class DDPGradients:
    """This rank's gradient, averaged over the ranks by DDP's comm hook during backward; a worker-gradient
    function (`distlion.cluster.grads`) whose `last_times` says how much communication backward hid."""

    def __init__(self, model: nn.Module, flat: FlatParams, method: Method, seed: int):
        if len(flat.dtypes) != 1:
            raise ValueError(f"method={method.name} needs one parameter dtype; the model has {flat.dtypes}")
        self.flat, self.method = flat, method
        # Buffers (LLaMA's rotary frequencies) are equal on every rank: no broadcast before each forward.
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=method.bucket_cap_mb, **_NO_BUFFER_SYNC)
        state, hook = method.comm_hook(seed, model)
        if getattr(method, "compression", None) == "powersgd":
            hook = in_bucket_order(hook)
        self.spans: list[tuple[float, float]] = []
        self.ddp.register_comm_hook(state, self._timed(hook))
        self.last_times: dict[str, float] = {}

    def _timed(self, hook: Any) -> Any:
        def timed_hook(state, bucket):  # no annotations: DDP checks them against its own types
            start = time.perf_counter()

            def done(fut: torch.futures.Future) -> torch.Tensor:
                self.spans.append((start, time.perf_counter()))
                return fut.value()

            return hook(state, bucket).then(done)

        return timed_hook

    def __call__(self, model: nn.Module, flat: FlatParams, per_example_loss: LossFn, inputs: torch.Tensor,
                 targets: torch.Tensor, num_workers: int) -> WorkerGrads:
        if num_workers != 1:
            raise ValueError("DDP runs one worker per process")
        self.spans = []
        with PayloadLog() as log:
            loss = per_example_loss(self.ddp, inputs, targets).mean()
            loss.backward()
        end = time.perf_counter()
        if isinstance(self.method, DDPMethod):
            self.method.sent = log.sent
        (dtype,) = flat.dtypes
        grads = torch.cat([p.grad.reshape(-1) for p in flat.params[dtype]]).unsqueeze(0)
        for p in flat.params[dtype]:
            p.grad = None
        comm = busy_time(self.spans)
        exposed = min(comm, max(0.0, end - max((s for s, _ in self.spans), default=end)))
        self.last_times = {"comm": comm, "comm_exposed": exposed, "comm_hidden": comm - exposed}
        return {dtype: grads}, loss.detach().reshape(1)
