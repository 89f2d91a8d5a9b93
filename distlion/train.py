"""The runner: `python -m distlion.train method=dlion cluster.workers=8 task=digits seed=0`.

One visible loop, in the order of the paper's Algorithm 1:
batch -> per-worker gradients -> worker messages -> server message -> apply -> metrics.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from distlion.cluster import build_cluster
from distlion.cluster.grads import worker_grads
from distlion.cluster.sampler import ShardedSampler
from distlion.flat import FlatParams
from distlion.loggers import NullLogger, build_logger
from distlion.methods import build_method
from distlion.runio import (
    atomic_torch_save,
    atomic_write_text,
    config_hash,
    exclusive_run_dir,
    git_version,
    read_summary,
    resolved_config,
)
from distlion.schedule import LRSchedule
from distlion.seeding import derive_seed


class ConfigError(ValueError):
    """A setting that cannot work; the message names it and says what to change."""


def build_run(cfg: DictConfig):
    """Task, model, flat parameters, cluster and sampler, validated before any training."""
    method_cfg = OmegaConf.to_container(cfg.method, resolve=True)
    method = build_method(method_cfg.pop("name"), **method_cfg)
    task = hydra.utils.instantiate(cfg.task, model=cfg.model, _recursive_=False)
    sampler = ShardedSampler(task.num_train, cfg.cluster.workers, cfg.cluster.per_worker_batch, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = task.build_model()
    model.train()
    flat = FlatParams(model)
    cluster = build_cluster(cfg.cluster, method, flat, cfg.seed)
    return task, model, flat, cluster, sampler, method


def total_steps(cfg: DictConfig, sampler: ShardedSampler) -> int:
    if cfg.train.steps is not None:
        steps = int(cfg.train.steps)
    else:
        steps = math.ceil(cfg.train.epochs * sampler.steps_per_epoch)
    if steps < 1:
        raise ConfigError(f"the run has {steps} steps; set train.epochs or train.steps to a positive value")
    return steps


def worker_batches(task, sampler: ShardedSampler, workers: list[int], step: int, seed: int):
    """The rows of `workers` in step `step`, worker after worker. Each worker augments its batch with
    its own generator (seed, step, worker), so a rank under torch.distributed draws what the same
    worker draws in the simulated cluster."""
    indices = sampler.indices(step)
    batches = [task.train_batch(indices[w], torch.Generator().manual_seed(derive_seed(seed, step, w))) for w in workers]
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def run(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train one configuration into `run_dir`; returns the summary. Resumes from a checkpoint and
    skips a finished run of the same config; refuses a directory holding another config's results
    or one that another live process is writing."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_run_dir(run_dir):
        return _run(cfg, run_dir)


def _run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    digest = config_hash(cfg)
    finished = read_summary(run_dir)
    if finished is not None:
        if finished.get("config_hash") == digest:
            print(f"distlion: {run_dir} already holds this finished run; skipping it", file=sys.stderr)
            return finished
        raise ConfigError(
            f"{run_dir} holds a finished run of another config (hash {finished.get('config_hash')} != {digest}); "
            "choose another experiment= or hydra.run.dir, finished results are never overwritten"
        )

    if cfg.train.get("threads"):
        torch.set_num_threads(cfg.train.threads)
    task, model, flat, cluster, sampler, method = build_run(cfg)
    steps = total_steps(cfg, sampler)
    method.check_run(steps / sampler.steps_per_epoch)
    schedule = LRSchedule(method.lr, steps, **cfg.schedule)
    compute_grads = worker_grads(cfg.cluster.grad_strategy)
    eval_every = cfg.train.eval_every or max(1, steps // cfg.train.num_evals)
    num_params = flat.numel
    workers = cfg.cluster.workers

    config = resolved_config(cfg)
    state = {"step": 0, "cum_bits_per_param": 0.0, "total_bits": 0, "bits_up": 0, "bits_down": 0}
    # One process per worker (cluster=torchdist): each rank holds its own worker state and file.
    shard = "" if len(cluster.local_workers) == workers else f".rank{cluster.local_workers[0]}"
    checkpoint_path = run_dir / f"checkpoint{shard}.pt"
    if checkpoint_path.exists():
        state = _resume(checkpoint_path, digest, flat, cluster)
        print(f"distlion: resuming {run_dir} from step {state['step']}", file=sys.stderr)
    metrics_path = run_dir / "metrics.jsonl"
    if cluster.is_main:  # only one process writes results and logs
        atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        _truncate_metrics(metrics_path, state["step"])

    name = HydraConfig.get().job.override_dirname if HydraConfig.initialized() else run_dir.name
    tags = [f"method={method.name}", f"workers={workers}", f"batch={cfg.cluster.per_worker_batch}"]
    if method.name == "dlion":
        tags.append(f"aggregation={method.aggregation}")
    logger = (build_logger(cfg.logger, config, str(run_dir), cfg.experiment, name or run_dir.name, tags)
              if cluster.is_main else NullLogger())
    start_time = time.time() - state.get("wall_time", 0.0)
    last_eval: dict[str, float] = {}
    try:
        bar = tqdm(range(state["step"], steps), initial=state["step"], total=steps,
                   disable=not (cfg.train.progress and cluster.is_main),
                   desc=f"{method.name} N={workers}", dynamic_ncols=True, file=sys.stderr)
        with metrics_path.open("a") if cluster.is_main else open(os.devnull, "w") as metrics_file:
            for step in bar:
                inputs, targets = worker_batches(task, sampler, cluster.local_workers, step, cfg.seed)
                grads, losses = compute_grads(model, flat, task.per_example_loss, inputs, targets,
                                              len(cluster.local_workers))
                loss = cluster.mean_loss(losses)
                if not math.isfinite(loss):
                    raise FloatingPointError(
                        f"train loss is {loss} at step {step}; lower method.lr (now {method.lr}) or check the data"
                    )
                lr = schedule(step)
                bits = cluster.step(grads, step=step, lr=lr, epoch=sampler.epoch(step))
                state["step"] = step + 1
                state["bits_up"] += sum(bits.up) / workers
                state["bits_down"] += bits.down
                state["cum_bits_per_param"] += (sum(bits.up) / workers + bits.down) / num_params
                state["total_bits"] += bits.total
                record = {
                    "step": step + 1,
                    "epoch": sampler.epoch(step + 1),
                    "lr": lr,
                    "train_loss": loss,
                    "bits_up_per_param": sum(bits.up) / workers / num_params,
                    "bits_down_per_param": bits.down / num_params,
                    "cum_bits_per_param": state["cum_bits_per_param"],
                    "total_bits": state["total_bits"],
                }
                wire = getattr(bits, "wire", None)  # what this rank's collectives moved (cluster=torchdist)
                if wire is not None:
                    record["wire_bytes"] = wire.total
                    state["wire_bytes"] = state.get("wire_bytes", 0) + wire.total
                is_last = step + 1 == steps
                if ((step + 1) % eval_every == 0 or is_last) and cluster.is_main:
                    last_eval = task.evaluate(model)
                    record.update(last_eval)
                if (step + 1) % cfg.train.log_every == 0 or last_eval is record or "eval_loss" in record or is_last:
                    record["wall_time"] = time.time() - start_time
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                    logger.log(record, step + 1)
                bar.set_postfix(loss=f"{loss:.3f}", **{k: f"{v:.3f}" for k, v in last_eval.items()},
                                bits=f"{record['cum_bits_per_param']:.3g}")
                if cfg.train.checkpoint_every and (step + 1) % cfg.train.checkpoint_every == 0 and not is_last:
                    state["wall_time"] = time.time() - start_time
                    _save_checkpoint(checkpoint_path, digest, state, flat, cluster)
        summary = {
            "method": method.name,
            **{f"method.{k}": v for k, v in method.hparams().items() if k != "lr"},
            "lr": method.lr,
            "workers": workers,
            "per_worker_batch": cfg.cluster.per_worker_batch,
            "global_batch": workers * cfg.cluster.per_worker_batch,
            "task": cfg.task._target_.rsplit(".", 1)[-1],
            "seed": cfg.seed,
            "steps": steps,
            "epochs": steps / sampler.steps_per_epoch,
            "num_params": num_params,
            **last_eval,
            "metric": task.metric,
            "bits_up_per_param_per_iter": state["bits_up"] / steps / num_params,
            "bits_down_per_param_per_iter": state["bits_down"] / steps / num_params,
            "bits_per_param_per_iter": state["cum_bits_per_param"] / steps,
            "cum_bits_per_param": state["cum_bits_per_param"],
            "total_bits": state["total_bits"],
            **({"wire_bytes_per_step": state["wire_bytes"] / steps} if "wire_bytes" in state else {}),
            "wall_time": time.time() - start_time,
            "params_sha256": params_digest(flat),
            "config_hash": digest,
            **git_version(),
        }
        if cluster.is_main:
            atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
        checkpoint_path.unlink(missing_ok=True)
        return summary
    finally:
        logger.finish()


def params_digest(flat: FlatParams) -> str:
    """sha256 of the final parameters' bytes: two runs ended bitwise equal iff these match."""
    digest = hashlib.sha256()
    for dtype in flat.dtypes:
        digest.update(flat.buffers[dtype].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _save_checkpoint(path: Path, digest: str, state: dict, flat: FlatParams, cluster) -> None:
    atomic_torch_save(
        {
            "config_hash": digest,
            "state": dict(state),
            "params": {str(d): b.clone() for d, b in flat.buffers.items()},
            "cluster": cluster.state_dict(),
            "torch_rng": torch.get_rng_state(),
        },
        path,
    )


def _resume(path: Path, digest: str, flat: FlatParams, cluster) -> dict:
    checkpoint = torch.load(path, weights_only=False)
    if checkpoint["config_hash"] != digest:
        raise ConfigError(
            f"{path} was written by another config (hash {checkpoint['config_hash']} != {digest}); "
            "rerun with the original settings, or delete the checkpoint to start over"
        )
    for dtype, buffer in flat.buffers.items():
        buffer.copy_(checkpoint["params"][str(dtype)])
    cluster.load_state_dict(checkpoint["cluster"])
    torch.set_rng_state(checkpoint["torch_rng"])
    return checkpoint["state"]


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep only the lines a resumed run will not write again."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Console entry point (`distlion-train`). A bad setting prints one line, not a traceback."""
    try:
        summary = run(cfg, HydraConfig.get().runtime.output_dir)
    except (ValueError, FloatingPointError) as err:
        print(f"distlion: error: {err}", file=sys.stderr)
        sys.exit(2)
    return summary.get(summary["metric"])


if __name__ == "__main__":
    main()
