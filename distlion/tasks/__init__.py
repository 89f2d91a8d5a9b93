"""Tasks: data + model + loss + evaluation, built from the `task` and `model` config groups.

A task is named by its config file: conf/task/<name>.yaml starts with `name: <name>`, and a run's
summary.json records that name, the task's declared metrics and its splits. Summaries written before then
hold the class name, no metrics and `eval_*` keys; `task_metrics(..., legacy=True)` and `task_name` read
them through the configs' `_target_`.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from distlion.tasks.base import ClassificationTask, Metric, Task

TASK_CONFIGS = Path(__file__).resolve().parents[2] / "conf" / "task"


def build_task(cfg: DictConfig, model: Any) -> Task:
    """The task of a `task` config; its `name` and `target` are for reports, not constructor arguments."""
    kwargs = OmegaConf.to_container(cfg, resolve=True)
    kwargs.pop("name", None)
    kwargs.pop("target", None)
    return hydra.utils.instantiate(kwargs, model=model, _recursive_=False)


def _targets() -> dict[str, str]:
    """Config name -> the class path (`_target_`) of conf/task/<name>.yaml."""
    return {p.stem: OmegaConf.load(p)._target_ for p in sorted(TASK_CONFIGS.glob("*.yaml"))}


def _configs_of(name: str) -> list[str]:
    """The config names of a config name or of a task class name."""
    return [c for c, target in _targets().items() if name in (c, target.rsplit(".", 1)[-1])]


def task_class(name: str) -> type[Task]:
    """A task class by config name or class name, importing only its module (some import heavy libraries)."""
    configs = _configs_of(name)
    if not configs:
        raise ValueError(f"task {name!r} is neither a config in {TASK_CONFIGS} nor the class of one")
    module, cls = _targets()[configs[0]].rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)


def task_metrics(name: str, legacy: bool = False) -> tuple[Metric, ...]:
    """The metrics a task declares (headline first), by config name or class name; `legacy`: those of its
    summaries from before the validation split (no "metrics" key, `eval_*` keys)."""
    cls = task_class(name)
    return cls.legacy_metrics if legacy else cls.metrics


def task_name(name: str) -> str:
    """A summary's task as a reader knows it: the config name. A class name (older summaries) maps to
    its config when only one config uses the class, else to words: "LanguageModelTask" -> "language model"."""
    configs = _configs_of(name)
    if len(configs) == 1:
        return configs[0]
    return re.sub(r"(?<!^)(?=[A-Z])", " ", name.removesuffix("Task")).lower()


__all__ = ["ClassificationTask", "Metric", "Task", "build_task", "task_class", "task_metrics", "task_name"]
