"""Validation of a run's config: once, before anything is built, one line per bad setting.

Settings that depend on the data (a per-worker batch larger than a worker's shard) or on the
run's length (DGC's warm-up) are checked as soon as the data set and the step count are known,
still before the first step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from distlion.amp import amp_dtype
from distlion.cluster import BACKENDS
from distlion.cluster.base import check_workers
from distlion.cluster.grads import STRATEGIES
from distlion.device import resolve_device, resolve_dist_backend
from distlion.methods import build_method
from distlion.methods.base import Method
from distlion.methods.step import NONFINITE_POLICIES

#: Set by distlion-netem for its ranks: the rate of their links ("none": uncapped).
LINK_ENV = "DISTLION_LINK"
PARAM_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A setting that cannot work; the message names it and says what to change."""


def _whole(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be >= {minimum}, a whole number")


def method_from_config(cfg: DictConfig) -> Method:
    """The configured method, built: its registry entry checks the names, its constructor the values."""
    settings = OmegaConf.to_container(cfg.method, resolve=True)
    return build_method(settings.pop("name"), **settings)


def validate(cfg: DictConfig) -> Method:
    """Check every setting of `cfg`; returns the built method. Raises `ConfigError` (one line)."""
    try:
        method = method_from_config(cfg)
        if cfg.cluster.backend not in BACKENDS:
            raise ConfigError(f"cluster.backend={cfg.cluster.backend!r} is unknown; choose one of {BACKENDS}")
        check_workers(cfg.cluster.workers)
        if cfg.cluster.backend not in method.backends:
            raise ConfigError(f"method={cfg.method.name} runs only under cluster={' or '.join(method.backends)} "
                              f"(one process per worker: torchrun --nproc-per-node {cfg.cluster.workers} -m "
                              f"distlion.train cluster=torchdist method={cfg.method.name} ...)")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _whole("cluster.per_worker_batch", cfg.cluster.per_worker_batch, 1)
    link, actual = cfg.cluster.get("link"), os.environ.get(LINK_ENV)
    if link is not None and str(link) != actual:
        raise ConfigError(f"cluster.link={link} but this process runs on {actual or 'no emulated link'}; launch it "
                          f"with distlion-netem --rate {link} -- torchrun ...")
    if cfg.cluster.grad_strategy not in STRATEGIES:
        raise ConfigError(f"cluster.grad_strategy={cfg.cluster.grad_strategy!r} is unknown; "
                          f"choose one of {sorted(STRATEGIES)}")
    train = cfg.train
    if train.steps is None and not (isinstance(train.epochs, int | float) and train.epochs > 0):
        raise ConfigError(f"train.epochs={train.epochs!r} must be > 0 (or set train.steps)")
    _whole("train.steps", train.steps, 1, optional=True)
    _whole("train.eval_every", train.eval_every, 1, optional=True)
    _whole("train.num_evals", train.num_evals, 1)
    _whole("train.local_eval_every", train.get("local_eval_every", 1), 1)
    _whole("train.log_every", train.log_every, 1)
    _whole("train.checkpoint_every", train.checkpoint_every, 0)
    _whole("train.threads", train.get("threads"), 1, optional=True)
    _whole("schedule.warmup_steps", cfg.schedule.warmup_steps, 0)
    if train.dtype not in PARAM_DTYPES:
        raise ConfigError(f"train.dtype={train.dtype!r} is unknown; choose one of {PARAM_DTYPES}")
    if method.exchange == "in_backward" and train.dtype != "float32":
        raise ConfigError(f"method={cfg.method.name} keeps fp32 parameters (train.dtype=float32); DDP's bf16/fp16 "
                          "compression is method=ddp_bf16 / ddp_fp16")
    if not isinstance(train.get("save_model", False), bool):
        raise ConfigError(f"train.save_model={train.save_model!r} must be true or false")
    fewshot = cfg.get("eval")
    if fewshot is not None:
        if not all(isinstance(name, str) for name in fewshot.tasks):
            raise ConfigError(f"eval.tasks={list(fewshot.tasks)} must be task names, e.g. [nextline,lastword]")
        _whole("eval.num_fewshot", fewshot.num_fewshot, 0)
        _whole("eval.limit", fewshot.limit, 1, optional=True)
        _whole("eval.batch_size", fewshot.batch_size, 1)
    if not isinstance(train.master_weights, bool):
        raise ConfigError(f"train.master_weights={train.master_weights!r} must be true or false")
    try:
        device = resolve_device(train.get("device", "auto"))
        amp = amp_dtype(train.get("amp", "none"))
        if cfg.cluster.backend == "torchdist":
            resolve_dist_backend(cfg.cluster.get("dist_backend", "auto"), device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if amp is not None and train.dtype != "float32":
        raise ConfigError(f"train.amp={train.amp} computes in {train.amp} on fp32 parameters, train.dtype="
                          f"{train.dtype} makes the parameters low precision: set one of them (README, 'Precision')")
    if amp == torch.float16 and method.exchange == "in_backward":  # its hook would exchange scaled gradients
        raise ConfigError(f"train.amp=fp16: method={cfg.method.name} exchanges inside backward, before the loss scale "
                          "is taken out and an overflow can skip the step; use train.amp=bf16")
    if not isinstance(train.get("compile", False), bool):
        raise ConfigError(f"train.compile={train.compile!r} must be true or false")
    if train.get("compile", False) and cfg.cluster.grad_strategy != "sequential":
        raise ConfigError(f"train.compile=true compiles the model's own forward, which cluster.grad_strategy="
                          f"{cfg.cluster.grad_strategy} replaces per layer; use cluster.grad_strategy=sequential")
    if train.nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"train.nonfinite={train.nonfinite!r} is unknown; choose one of {NONFINITE_POLICIES}")
    return method
