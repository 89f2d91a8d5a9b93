"""The runner: `python -m distlion.train method=dlion cluster.workers=8 task=digits seed=0`.

One visible loop (`train`): batch -> per-worker gradients -> the cluster's Algorithm 1 step
(worker messages -> server message -> apply) -> metrics. The run directory (`distlion.runio.RunDir`)
owns skipping, refusing, checkpoints and resuming; `distlion.config.validate` checks the settings.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch import nn
from torch.utils._pytree import tree_map_only
from tqdm import tqdm

from distlion.amp import LossScale, amp_dtype, autocast_loss, unscale
from distlion.cli import Interrupted, run_app, run_point
from distlion.cluster import Cluster, build_cluster
from distlion.cluster.base import BitsTally
from distlion.cluster.jobs import Preemption, export_rank_environment
from distlion.cluster.sampler import ShardedSampler, build_shards, shard_record
from distlion.config import LINK_ENV, ConfigError, validate
from distlion.device import configure_backends, describe, resolve_device
from distlion.flat import FlatParams
from distlion.loggers import NullLogger, build_logger
from distlion.methods import Method, variant_of
from distlion.methods.step import PhaseTimer
from distlion.runio import RunDir, atomic_write_text, config_hash, git_version, machine, resolved_config
from distlion.schedule import LRSchedule
from distlion.seeding import derive_seed
from distlion.tasks import Task, build_task


@dataclass
class Run:
    """Everything one training run is made of, built and validated before its first step."""

    task: Task
    model: nn.Module
    flat: FlatParams
    cluster: Cluster
    sampler: ShardedSampler
    steps: int


def build_run(cfg: DictConfig, method: Method, device: torch.device | None = None) -> Run:
    """Task, model, flat parameters, cluster and sampler of a validated config and its built method, on `device`
    (the CPU by default)."""
    task = build_task(cfg.task, cfg.model)
    if cfg.get("eval") and cfg.eval.tasks and not hasattr(task, "fewshot"):
        raise ConfigError(f"eval.tasks={list(cfg.eval.tasks)}: few-shot evaluation is for LM tasks, not task "
                          f"{cfg.task.get('name')}; drop eval.tasks")
    if cfg.train.get("save_model") and not hasattr(task, "save_model"):
        raise ConfigError(f"train.save_model=true: task {cfg.task.get('name')} cannot save its model in a form a "
                          "later run loads (LM tasks can); drop train.save_model")
    sharding, alpha = cfg.cluster.get("shards", "iid"), cfg.cluster.get("alpha", 0.1)
    shards = build_shards(sharding, task, cfg.cluster.workers, cfg.seed, alpha, cfg.cluster.per_worker_batch)
    sampler = ShardedSampler(task.num_train, cfg.cluster.workers, cfg.cluster.per_worker_batch, cfg.seed, shards)
    sampler.record = shard_record(shards, sharding, alpha, getattr(task, "train_labels", lambda: None)(),
                                  task.num_train, cfg.cluster.workers)
    steps = cfg.train.steps if cfg.train.steps is not None else math.ceil(cfg.train.epochs * sampler.steps_per_epoch)
    method.check_run(steps / sampler.steps_per_epoch)
    torch.manual_seed(cfg.seed)
    model = task.build_model().to(device or "cpu")
    model.train()
    dtype = getattr(torch, cfg.train.dtype)
    if dtype != torch.float32:
        model.to(dtype)
        # Floating inputs (images) follow the parameters; token ids stay integers.
        model.register_forward_pre_hook(functools.partial(_cast_inputs, dtype=dtype), with_kwargs=True)
    flat = FlatParams(model)
    if cfg.train.get("compile"):
        model.compile()  # in place: the parameters stay the flat buffers' views
    cluster = build_cluster(cfg.cluster, method, flat, cfg.seed, cfg.train.nonfinite, cfg.train.master_weights)
    return Run(task, model, flat, cluster, sampler, steps)


def _cast_inputs(module: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def worker_batches(task: Task, sampler: ShardedSampler, workers: list[int], step: int, seed: int,
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `workers` in step `step`, worker after worker, on `device`. Each worker augments its batch
    on the CPU with its own generator (seed, step, worker), so a rank under torch.distributed draws what the
    same worker draws in the simulated cluster, on any device."""
    indices = sampler.indices(step)
    batches = [task.train_batch(indices[w], torch.Generator().manual_seed(derive_seed(seed, step, w))) for w in workers]
    inputs, targets = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    return to_device(inputs, device), to_device(targets, device)


def to_device(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A CPU batch on `device`: to a GPU from pinned memory without blocking (the copy overlaps queued work)."""
    if device is None or device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def run(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train one configuration into `run_dir`; returns the summary. Resumes from a checkpoint and
    skips a finished run of the same config; refuses a directory holding another config's results
    or one that another live process is writing."""
    if cfg.cluster.backend == "torchdist":
        export_rank_environment(cfg.cluster)  # a task of a submitit job: its rank, as torchrun would give it
    method = validate(cfg)
    with RunDir(run_dir, config_hash(cfg), config_hash(cfg, device=False)).hold() as directory:
        finished = directory.finished()
        if finished is not None:
            print(f"distlion: {directory.path} already holds this finished run; skipping it", file=sys.stderr)
            return finished
        return train(cfg, method, directory)


def train(cfg: DictConfig, method: Method, directory: RunDir) -> dict[str, Any]:
    """Algorithm 1, step after step: batch -> per-worker gradients -> cluster step -> metrics."""
    if cfg.train.get("threads"):
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.get("device", "auto"))
    configure_backends(device)
    r = build_run(cfg, method, device)
    task, model, flat, cluster = r.task, r.model, r.flat, r.cluster
    sampler, steps = r.sampler, r.steps
    schedule = LRSchedule(method.lr, steps, **cfg.schedule)
    compute_grads = cluster.gradients(model, cfg.cluster.grad_strategy)
    amp = amp_dtype(cfg.train.get("amp", "none"))
    scaler = LossScale() if amp == torch.float16 else None
    per_example_loss = autocast_loss(task.per_example_loss, device, amp, scaler)
    eval_every = cfg.train.eval_every or max(1, steps // cfg.train.num_evals)
    local_eval_every = cfg.train.get("local_eval_every", 1)
    workers, suffix = cfg.cluster.workers, cluster.backend.shard_suffix

    start_step, wall_time, bits = 0, 0.0, BitsTally(flat.numel)
    checkpoint = _agreed_checkpoint(directory, suffix, cluster)
    if checkpoint is not None:
        moved = checkpoint["config_hash"] != directory.config_hash  # written on another device
        start_step, wall_time, bits = _restore(checkpoint, flat, cluster, scaler)
        print(f"distlion: resuming {directory.path} from step {start_step} on {describe(device)}", file=sys.stderr)
    else:
        print(f"distlion: training on {describe(device)}", file=sys.stderr)
    resume_gap = method.resume_gap() if checkpoint is not None else None
    if checkpoint is not None and moved:
        resume_gap = "; ".join(filter(None, [resume_gap, "resumed from a checkpoint written on another device, whose "
                                             "float arithmetic differs"]))
    if resume_gap is not None:
        print(f"distlion: warning: this resumed run differs from an uninterrupted one: {resume_gap}", file=sys.stderr)
    if cluster.is_main:  # only one process writes results and logs
        directory.write_config(cfg)
        if sampler.given is not None:  # non-IID: each shard's size and label histogram
            atomic_write_text(directory.path / "shards.json", json.dumps(sampler.record))
    variant = variant_of(method.name, method.hparams()).name
    tags = [f"method={variant}", f"workers={workers}", f"batch={cfg.cluster.per_worker_batch}"]
    name = HydraConfig.get().job.override_dirname if HydraConfig.initialized() else ""
    logger = (build_logger(cfg.logger, resolved_config(cfg), str(directory.path), cfg.experiment,
                           name or directory.path.name, tags)
              if cluster.is_main else NullLogger())
    start_time = time.time() - wall_time
    last_eval: dict[str, float] = {}
    evals_done = start_step // eval_every  # a resumed run keeps counting where it left off
    clock = StepClock()
    preemption = Preemption(device)  # a submitit job's preemption notice: checkpoint at an agreed step, then requeue
    step, saved = start_step, start_step  # saved: the step a rerun resumes from (its last checkpoint; 0: none)
    try:
        bar = tqdm(range(start_step, steps), initial=start_step, total=steps,
                   disable=not (cfg.train.progress and cluster.is_main),
                   desc=f"{variant} N={workers}", dynamic_ncols=True, file=sys.stderr)
        with directory.open_metrics(start_step) if cluster.is_main else open(os.devnull, "w") as metrics_file:
            for step in bar:
                step_start = time.perf_counter()
                inputs, targets = worker_batches(task, sampler, cluster.local_workers, step, cfg.seed, device)
                timer = PhaseTimer(flat.device, ("compute",))
                with timer.phase("compute"):
                    grads, losses = compute_grads(model, flat, per_example_loss, inputs, targets,
                                                  len(cluster.local_workers))
                if scaler is not None:
                    unscale(scaler, grads, losses)
                loss = cluster.mean_loss(losses)
                # (fp16: an overflow is the loss scale's to handle: the step is skipped everywhere)
                if not math.isfinite(loss) and cfg.train.nonfinite == "error" and scaler is None:
                    raise FloatingPointError(
                        f"train loss is {loss} at step {step}; lower method.lr (now {method.lr}) or check the data"
                    )
                lr = schedule(step)
                is_last = step + 1 == steps
                evaluate = (step + 1) % eval_every == 0 or is_last
                logged = evaluate or (step + 1) % cfg.train.log_every == 0
                step_bits = cluster.step(grads, step=step, lr=lr, epoch=sampler.epoch(step), diagnose=logged,
                                         final_sync=is_last and cfg.train.final_sync,
                                         nonfinite="skip" if scaler is not None else None)
                if scaler is not None:
                    scaler.update(step_bits.skipped)
                clock.add(step_times(timer.times, getattr(compute_grads, "last_times", {}), step_bits.times,
                                     time.perf_counter() - step_start))
                record = {"step": step + 1, "epoch": sampler.epoch(step + 1), "lr": lr, "train_loss": loss,
                          **bits.add(step_bits), **cluster.diagnostics(step_bits)}
                if evaluate:  # every process enters (with replicas the model that counts may be gathered)
                    evals_done += 1
                    score_local = is_last or evals_done % local_eval_every == 0
                    evaluated = evaluation(cfg, task, model, flat, cluster, is_last, score_local)
                    if cluster.is_main:
                        last_eval = evaluated
                        record.update(evaluated)
                if is_last:
                    cluster.finish()  # with replicas: the model keeps the parameters that count
                if logged:
                    record.update(clock.means())
                    if scaler is not None:
                        record["loss_scale"] = scaler.scale
                    record["wall_time"] = time.time() - start_time
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                    logger.log(record, step + 1)
                bar.set_postfix(loss=f"{loss:.3f}", **{k: f"{v:.3f}" for k, v in last_eval.items()},
                                bits=f"{record['cum_bits_per_param']:.3g}")
                preempted = not is_last and preemption.agreed()
                if preempted or (cfg.train.checkpoint_every and (step + 1) % cfg.train.checkpoint_every == 0
                                 and not is_last):
                    directory.save_checkpoint(suffix, _checkpoint(step + 1, time.time() - start_time, bits, flat,
                                                                  cluster, scaler))
                    saved = step + 1
                if preempted:
                    preemption.requeue()
        summary = {
            "method": variant,  # the registered (config) name, e.g. dlion_avg; its class is method_class
            "method_class": method.name,
            "exchange": method.exchange,
            **{f"method.{k}": v for k, v in method.hparams().items() if k != "lr"},
            "lr": method.lr,
            "workers": workers,
            "per_worker_batch": cfg.cluster.per_worker_batch,
            "global_batch": workers * cfg.cluster.per_worker_batch,
            **cluster.faults.summary(),
            "shards": sampler.record["kind"],
            **({"shard_alpha": sampler.record["alpha"]} if "alpha" in sampler.record else {}),
            "link": os.environ.get(LINK_ENV),  # the rate of each rank's emulated link (distlion-netem)
            "link_measured": float(os.environ["DISTLION_LINK_MEASURED"]) if "DISTLION_LINK_MEASURED" in os.environ
            else None,  # bits/s of a TCP transfer on it before the run (its check)
            "task": cfg.task.get("name", type(task).__name__),
            "seed": cfg.seed,
            "steps": steps,
            "epochs": steps / sampler.steps_per_epoch,
            "num_params": flat.numel,
            **last_eval,
            "metric": task.metric,
            "objective": task.objective,
            "metrics": [dataclasses.asdict(m) for m in task.metrics],
            "splits": task.splits,
            **bits.summary(steps),
            # Methods that sync every H steps: their bits per sync too (the per-iteration mean is the paper's axis).
            **sync_summary(method, bits.cum_bits_per_param, steps, cfg.train.final_sync),
            "wall_time": time.time() - start_time,
            "device": describe(device),
            **({"amp": cfg.train.amp} if amp is not None else {}),
            **({"resume_inexact": resume_gap} if resume_gap is not None else {}),
            "params_sha256": params_digest(flat),
            "config_hash": directory.config_hash,
            # The command-line overrides that made this config (the spec's index maps them to the hash).
            "overrides": list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None,
            **git_version(),
            "machine": machine(device),
        }
        if cluster.is_main and cfg.train.get("save_model"):
            task.save_model(model, directory.path / "model")
            summary["model_dir"] = "model"
        if cluster.is_main:
            directory.write_summary(summary)
        directory.remove_checkpoint(suffix)
        return summary
    except KeyboardInterrupt:
        where = f"from step {saved}" if saved else "from the start (train.checkpoint_every=K checkpoints a run)"
        raise Interrupted(f"interrupted at step {step} of {steps}; rerun the same command to resume {where}") from None
    finally:
        logger.finish()


def sync_summary(method: Method, cum_bits_per_param: float, steps: int, final_sync: bool) -> dict[str, Any]:
    """Methods that sync every H steps: how often they synced and their bits per sync (the per-iteration mean is the
    paper's axis; the per-sync figure prices one exchange on a link). Nothing for methods that exchange every step."""
    syncs = method.sync_count(steps, final_sync)
    if syncs is None:
        return {}
    per_sync = {"bits_per_param_per_sync": cum_bits_per_param / syncs} if syncs else {}
    return {"final_sync": final_sync, "syncs": syncs, **per_sync}


def step_times(compute: dict[str, float], in_backward: dict[str, float], step: dict[str, float],
               total: float) -> dict[str, float]:
    """One step's seconds per phase. Communication that ran inside backward (DDP's comm hook) counts as
    `comm`, and only its exposed part is taken out of `compute`; `comm_hidden` is what compute hid."""
    exposed = in_backward.get("comm_exposed", 0.0)
    return {"compute": compute["compute"] - exposed, **step,
            "comm": step.get("comm", 0.0) + in_backward.get("comm", 0.0),
            "comm_hidden": in_backward.get("comm_hidden", 0.0), "step": total}


class StepClock:
    """Seconds per step in each phase, averaged over the steps since the last metrics line: `time_compute`
    (forward and backward of the local workers), `time_encode`, `time_comm`, `time_apply` (see
    `distlion.methods.step.PHASES`), `time_comm_hidden` (see `step_times`) and `time_step` (the whole step,
    batches included; not evaluations)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.steps = 0

    def add(self, times: dict[str, float]) -> None:
        for name, seconds in times.items():
            self.sums[name] = self.sums.get(name, 0.0) + seconds
        self.steps += 1

    def means(self) -> dict[str, float]:
        """The averages, then start a new interval."""
        out = {f"time_{name}": total / self.steps for name, total in self.sums.items()} if self.steps else {}
        self.sums, self.steps = {}, 0
        return out


def evaluation(cfg: DictConfig, task: Task, model: nn.Module, flat: FlatParams, cluster: Cluster,
               is_last: bool, score_local: bool = True) -> dict[str, float]:
    """The model that counts, evaluated by the main process: during training the validation split only (cheap:
    `val_examples` of it), at the end all of it and the test split once (and the few-shot tasks); with replicas
    also their diagnostics (the workers' own models scored only when `score_local`). Every process calls it (the
    model that counts may be gathered from the ranks)."""
    workers_params = cluster.worker_params() if cluster.has_replicas else None
    out: dict[str, float] = {}
    with cluster.counted_params(workers_params):  # one gather serves the diagnostics and the model that counts
        if not cluster.is_main:
            return out
        if workers_params is not None:
            out |= replica_diagnostics(task, model, flat, workers_params, score_local)
        if is_last and cfg.train.test_eval:
            out |= final_evaluation(task, model)
            if cfg.get("eval") and cfg.eval.tasks:
                out |= task.fewshot(model, list(cfg.eval.tasks), cfg.eval.num_fewshot, cfg.eval.limit,
                                    cfg.eval.batch_size)
        else:
            out |= task.evaluate(model, "validation", None if is_last else task.val_examples)
    return out


def replica_diagnostics(task: Task, model: nn.Module, flat: FlatParams,
                        workers_params: list[dict[torch.dtype, torch.Tensor]],
                        score_local: bool = True) -> dict[str, float]:
    """For a method with a model replica per worker: `worker_drift`, the mean L2 distance of the workers'
    parameters from their average, and (when `score_local`) each validation metric of the workers' own models,
    averaged over workers (`<metric>_local_mean`; on `val_examples` of the split). The model holds its parameters
    again afterwards."""
    held = {d: b.clone() for d, b in flat.buffers.items()}
    distances = torch.zeros(len(workers_params), device=flat.device)
    for dtype in held:
        stacked = torch.stack([p[dtype].to(torch.float32) for p in workers_params])
        distances += (stacked - stacked.mean(0)).square().sum(1)
    scores: dict[str, list[float]] = {}
    for params in workers_params if score_local else ():
        for dtype, values in params.items():
            flat.buffers[dtype].copy_(values)
        for key, value in task.evaluate(model, "validation", task.val_examples).items():
            scores.setdefault(f"{key}_local_mean", []).append(value)
    for dtype, values in held.items():
        flat.buffers[dtype].copy_(values)
    return {"worker_drift": float(distances.sqrt().mean()), **{k: sum(v) / len(v) for k, v in scores.items()}}


def final_evaluation(task: Task, model: nn.Module) -> dict[str, float]:
    """All of validation, then the test split: the one place a run reads the test split, once, at its end.
    Everything that selects reads validation; the test numbers are for the final tables."""
    return {**task.evaluate(model, "validation"), **task.evaluate(model, "test")}


def params_digest(flat: FlatParams) -> str:
    """sha256 of the final parameters' bytes: two runs ended bitwise equal iff these match."""
    digest = hashlib.sha256()
    for dtype in flat.dtypes:
        digest.update(flat.buffers[dtype].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _agreed_checkpoint(directory: RunDir, suffix: str, cluster: Cluster) -> dict[str, Any] | None:
    """This process's checkpoint at the step all processes can resume at (their earliest latest checkpoint;
    a process that is ahead falls back to its previous one)."""
    checkpoint = directory.load_checkpoint(suffix)
    mine = checkpoint["step"] if checkpoint is not None else 0
    agreed = cluster.backend.agree_start(mine)
    if agreed != mine:
        checkpoint = directory.load_checkpoint(suffix, at_most=agreed) if agreed else None
        if (checkpoint["step"] if checkpoint is not None else 0) != agreed:
            raise ValueError(
                f"the ranks cannot resume at one step: {directory.checkpoint_path(suffix).name} is at step {mine} and "
                f"another rank's latest at {agreed}; delete the run directory's checkpoint*.pt files to start over"
            )
    return checkpoint


def _checkpoint(step: int, wall_time: float, bits: BitsTally, flat: FlatParams, cluster: Cluster,
                scaler: LossScale | None = None) -> dict[str, Any]:
    """What resuming at `step` needs: the parameters, the cluster's states, the bit counts, torch's RNGs (the
    CPU's, and on a GPU its own), the loss scale of fp16 runs."""
    return {
        "step": step,
        "wall_time": wall_time,
        "bits": dataclasses.asdict(bits),
        "params": {str(d): b.clone() for d, b in flat.buffers.items()},
        "cluster": cluster.state_dict(),
        "torch_rng": torch.get_rng_state(),
        **({"cuda_rng": torch.cuda.get_rng_state(flat.device)} if flat.device.type == "cuda" else {}),
        **({"loss_scale": scaler.state_dict()} if scaler is not None else {}),
    }


def _restore(checkpoint: dict[str, Any], flat: FlatParams, cluster: Cluster,
             scaler: LossScale | None = None) -> tuple[int, float, BitsTally]:
    """Resume from `checkpoint` (read onto the CPU), whichever device wrote it: its tensors go to the run's."""
    for dtype, buffer in flat.buffers.items():
        buffer.copy_(checkpoint["params"][str(dtype)])
    cluster.load_state_dict(tree_map_only(torch.Tensor, lambda t: t.to(flat.device), checkpoint["cluster"]))
    torch.set_rng_state(checkpoint["torch_rng"])
    if flat.device.type == "cuda" and "cuda_rng" in checkpoint:
        torch.cuda.set_rng_state(checkpoint["cuda_rng"], flat.device)
    if scaler is not None and "loss_scale" in checkpoint:
        scaler.load_state_dict(checkpoint["loss_scale"])
    return checkpoint["step"], checkpoint["wall_time"], BitsTally(**checkpoint["bits"])


# An absolute path: Hydra reads a relative one as the module `conf` when called from the console script.
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def hydra_task(cfg: DictConfig) -> float | None:
    """One run, or one point of a sweep: `distlion.cli.run_point` says what a bad setting does."""
    summary = run_point(run, cfg)
    # What a Hydra sweeper optimizes: the validation objective, never the test headline.
    return None if summary is None else summary.get(summary.get("objective", summary["metric"]))


def main() -> None:
    """Console entry point (`distlion-train`). A bad setting prints one `distlion: error:` line first, not a
    traceback; a sweep runs every point, records the failed ones and exits 1 at the end if any failed."""
    run_app(hydra_task)


if __name__ == "__main__":
    main()
