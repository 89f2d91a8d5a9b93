"""What a spec costs before it runs: `distlion-experiment SPEC --estimate` prints runs x steps x seconds per step =
device-hours on the device the runs would use (`train.device`: auto = CUDA when available), without training.

Runs: the spec's final runs (grid points x seeds) and, each counted apart, its `pretrain:` run and its tuning trials.
Steps per run: the runner's own `distlion.train.build_run`, once per data set and cluster shape, on a stand-in
in place of the model (`stand_in`: the model itself is built on the meta device, which gives its parameter count,
depth and config without memory), so the data are read, checked and sharded as a run does it: absent data is the
loaders' one error line.

Seconds per step, `SimulatedCluster`: N x one worker's forward + backward + the method's step (the N workers'
gradients cost N times one worker's; the method's step is its worker rules, exchange and apply in one process).
`cluster=torchdist`: one worker's forward + backward + the method's arithmetic for one worker, on each of the N
devices; the exchange over the network is not included (`distlion.costmodel` prices links).

- One worker's forward + backward is timed on one worker's batch of the real data (train.dtype, train.amp, and on
  the CPU the run's train.threads): the best of three steps, the first of which pays the one-time costs (of two
  when one takes over `BUDGET_S`).
- A model that does not fit the memory at hand (the device's free memory, or `--memory`) in `FIT_FACTOR` x its
  parameter bytes (weights, gradients and as much again for activations) is timed at depths 2 and 1 (layers or
  blocks: transformers' num_hidden_layers, timm's depth) and extrapolated linearly in depth.
- A step that would take over `BUDGET_S` is timed on a power-of-two micro-batch and scaled linearly in the batch
  (on a GPU an overestimate: small batches leave it idle).
- The method's step is timed on a stand-in of min(P, `STAND_IN`) parameters with N workers' random gradients, at
  the middle of the run (past DGC's warm-up), and scaled linearly to the model's P parameters.

Not counted: evaluations, few-shot evaluation, checkpoints, torch.compile, launching.
"""

from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from distlion.amp import amp_dtype, autocast_loss
from distlion.cli import error_line
from distlion.cluster import build_cluster
from distlion.cluster.sampler import ShardedSampler
from distlion.config import validate
from distlion.device import describe, resolve_device
from distlion.experiment import finetuning, netem_commands, sweep_commands, sweep_points
from distlion.flat import FlatParams
from distlion.methods import Method, label_order, variant_of
from distlion.methods.step import PhaseTimer
from distlion.tasks import Task
from distlion.tasks.lm import pretrained_source
from distlion.train import build_run
from distlion.tuning import Tuning, trial_spec

BUDGET_S = 2.0  # the longest step timed; a longer one is timed on a micro-batch and scaled
STAND_IN = 2**20  # parameters of the stand-in the method's step is timed on
FIT_FACTOR = 4  # a timed model's memory, in parameter bytes: weights, gradients, activations
REDUCED_DEPTHS = (2, 1)  # depths timed for a model that does not fit (linear in depth through both)
LOAD_LLAMA = "distlion.tasks.lm.load_llama"


@dataclass(frozen=True)
class Shape:
    """The full model of a run, as built on the meta device."""

    numel: int
    depth: int | None  # layers (transformers) or blocks (timm), None for a model of neither
    depth_key: str  # its setting in the model config


@dataclass(frozen=True)
class Planned:
    """What `build_run` made of a config: the task (with its data), the sampler and the run's steps."""

    task: Task
    sampler: ShardedSampler
    steps: int
    shape: Shape


@dataclass(frozen=True)
class WorkerTime:
    """One worker's forward + backward on its whole batch, and how it was obtained."""

    seconds: float
    how: str


@dataclass
class Row:
    """Runs of one section that share model, workers, batch, method and length."""

    section: str
    group: str
    steps: int
    seconds: float
    devices: int
    runs: int = 0
    order: tuple = field(default=(), compare=False)

    @property
    def hours(self) -> float:
        return self.runs * self.steps * self.seconds * self.devices / 3600


# --- the spec's runs --------------------------------------------------------------------------------------------


def spec_sections(spec: dict[str, Any], tuning: Tuning | None, runs_dir: Path) -> tuple[list[tuple[str, dict]], str]:
    """The spec's parts as specs of their own, in the order they run: its pretraining, its tuning trials, its final
    runs; and a note when the finetunes are timed on the pretraining's architecture (its model is not trained yet)."""
    sections, final, note = [], spec, ""
    if "pretrain" in spec:
        sections.append(("pretrain", {"name": spec["name"], "sweeps": [shlex.join(spec["pretrain"])]}))
        model_dir = runs_dir / "pretrain" / "model"
        if (model_dir / "config.json").is_file():
            final = finetuning(spec, model_dir)
        else:
            architecture = [o for o in spec["pretrain"] if o.startswith("model")]
            final = {**spec, "base": [*spec.get("base", []), *architecture]}
            note = f"finetunes timed on the pretraining's model ({' '.join(architecture)}): it is not trained yet"
    if tuning is not None:
        sections.append(("tuning", trial_spec(final, tuning)))
    sections.append(("final", final))
    return sections, note


def run_points(spec: dict[str, Any], extra: list[str]) -> list[list[str]]:
    """Every run of a spec as its overrides: the runs its sweep commands make (grid points x seeds; x links for a
    spec timed on emulated links, each with the link's own overrides, the link itself not emulated here)."""
    if "netem" in spec:
        commands = netem_commands(spec, extra, Path("runs"))
        return [[o for o in c[c.index("distlion.train") + 1:] if not o.startswith(("hydra", "cluster.link="))]
                for c in commands]
    points = []
    for command in sweep_commands(spec, extra, Path("runs")):
        overrides = [o for o in command[command.index("-m", 3) + 1:] if not o.startswith("hydra")]
        points += sweep_points(shlex.join(overrides))
    return points


# --- steps: build_run on a stand-in model -----------------------------------------------------------------------


def stand_in(of_target: str, **kwargs: Any) -> nn.Module:
    """The model `build_run` gets while planning: `of_target(**kwargs)` is built on the meta device (its size, depth
    and config, no memory), and a two-parameter module stands in for it, which build_run moves, flattens and binds
    a cluster to at no cost. It carries the model's `config` (a task checks a pretrained model's positions)."""
    with torch.device("meta"):
        model = hydra.utils.instantiate({"_target_": of_target, **kwargs})
    config = getattr(model, "config", None)
    depth = getattr(config, "num_hidden_layers", None) if config is not None else None
    if depth is None and isinstance(getattr(model, "blocks", None), nn.Sequential | nn.ModuleList):
        depth = len(model.blocks)
    module = nn.Linear(1, 1)
    module.config = config
    module.shape = Shape(sum(p.numel() for p in model.parameters() if p.requires_grad), depth,
                         "num_hidden_layers" if config is not None else "depth")
    return module


def llama_architecture(pretrained: str, vocab_size: int | None = None, num_hidden_layers: int | None = None
                       ) -> nn.Module:
    """What `load_llama` loads, with random weights: its config.json alone (a step takes as long, and none of a 7B
    model's 13 GB is read); `num_hidden_layers` reduces its depth."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(pretrained_source(pretrained))
    if vocab_size is not None and config.vocab_size < vocab_size:  # as load_llama refuses it
        raise ValueError(f"model.pretrained={pretrained} has {config.vocab_size} token embeddings, fewer than its "
                         f"tokenizer's {vocab_size} tokens")
    if num_hidden_layers is not None:
        config.num_hidden_layers = num_hidden_layers
    return LlamaForCausalLM(config)


def model_config(model: DictConfig, depth_key: str | None = None, depth: int | None = None) -> dict[str, Any]:
    """The model config the estimate builds: a pretrained LLaMA's architecture instead of its weights, at `depth`."""
    cfg = OmegaConf.to_container(model, resolve=True)
    if cfg.get("_target_") == LOAD_LLAMA:
        cfg["_target_"] = f"{__name__}.llama_architecture"
    if depth is not None:
        cfg[depth_key] = depth
    return cfg


def plan(cfg: DictConfig, method: Method) -> Planned:
    """`build_run` of `cfg` with the stand-in model, on the CPU, in a simulated cluster of the same workers (a
    torchdist cluster would join a process group): the runner's task, sampler and steps."""
    planning = cfg.copy()
    with open_dict(planning):
        target = model_config(cfg.model)
        planning.model = {"_target_": f"{__name__}.stand_in", "of_target": target.pop("_target_"), **target}
        planning.cluster.backend = "simulated"
    run = build_run(planning, method)
    return Planned(run.task, run.sampler, run.steps, run.model.shape)


def plan_key(cfg: DictConfig) -> str:
    """Configs with the same key share their data and steps: the method and (IID shards) the seed aside."""
    rest = OmegaConf.to_container(cfg, resolve=True)
    for key in ("method", "logger", "experiment", "schedule"):
        rest.pop(key, None)
    if cfg.cluster.get("shards", "iid") == "iid":
        rest.pop("seed", None)
    return OmegaConf.to_yaml(rest)


# --- timing -----------------------------------------------------------------------------------------------------


def free_memory(device: torch.device) -> int:
    """Bytes the timing may use: CUDA's free memory, or the CPU's MemAvailable."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what earlier timings' models left in torch's cache is free for this one
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def timed(step: Callable[[], None], device: torch.device, repeats: int = 3, budget: float = BUDGET_S) -> float:
    """Seconds of one `step`: the best of `repeats` steps (the first pays one-time costs, allocation and kernel
    selection for these shapes; other processes only ever slow a step down), or of two when one took over `budget`."""
    best = math.inf
    for i in range(repeats):
        timer = PhaseTimer(device, ("step",))  # waits for the device's queued work at both ends
        with timer.phase("step"):
            step()
        best = min(best, timer.times["step"])
        if i >= 1 and best > budget:
            break
    return best


def worker_step(task: Task, cfg: DictConfig, indices: torch.Tensor, depth: int | None, depth_key: str,
                device: torch.device) -> Callable[[int], Callable[[], None]]:
    """`step(size)`: one worker's forward + backward on the first `size` examples of its batch (`indices`), the model
    built on `device` at `depth` (None: as configured), in the run's dtype and autocast."""
    dtype = getattr(torch, cfg.train.dtype)
    loss = autocast_loss(task.per_example_loss, device, amp_dtype(cfg.train.get("amp", "none")))
    task.model_cfg = OmegaConf.create(model_config(cfg.model, depth_key, depth))
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = task.build_model().to(dtype)
    model.train()

    def step(size: int) -> Callable[[], None]:
        x, y = task.train_batch(indices[:size], torch.Generator().manual_seed(cfg.seed))
        x, y = (x.to(device, dtype) if x.is_floating_point() else x.to(device)), y.to(device)

        def forward_backward() -> None:
            loss(model, x, y).mean().backward()
            model.zero_grad(set_to_none=True)

        return forward_backward

    return step


def micro_batch(step: Callable[[int], Callable[[], None]], batch: int, device: torch.device) -> tuple[int, float]:
    """(examples to time, seconds per example of two): the whole batch if a step of it fits in BUDGET_S, else the
    largest power of two that does (at least two: mixup pairs the examples of a batch)."""
    probe = min(2, batch)
    per_example = timed(step(probe), device) / probe
    if per_example * batch <= BUDGET_S:
        return batch, per_example
    return min(batch, max(probe, 2 ** int(math.log2(max(1.0, BUDGET_S / per_example))))), per_example


def time_worker(planned: Planned, cfg: DictConfig, device: torch.device, memory: int) -> WorkerTime:
    """One worker's forward + backward on its batch of the run's first step, at full depth if the model fits
    `memory` bytes, else at REDUCED_DEPTHS and extrapolated linearly in depth (see the module's docstring)."""
    shape, itemsize = planned.shape, getattr(torch, cfg.train.dtype).itemsize
    if device.type == "cpu" and cfg.train.get("threads"):
        torch.set_num_threads(cfg.train.threads)  # as the run computes
    indices = planned.sampler.indices(0)[0]
    batch, need = len(indices), FIT_FACTOR * shape.numel * itemsize
    if need <= memory:
        step = worker_step(planned.task, cfg, indices, None, shape.depth_key, device)
        micro, per_example = micro_batch(step, batch, device)
        seconds = per_example * batch if micro == min(2, batch) else timed(step(micro), device) * batch / micro
        return WorkerTime(seconds, _micro_note(micro, batch))
    does_not_fit = (f"{shape.numel / 1e9:.3g} B parameters need ~{need / 2**30:.3g} GiB to be timed, "
                    f"{memory / 2**30:.3g} GiB at hand")
    if shape.depth is None or shape.depth <= max(REDUCED_DEPTHS):
        raise ValueError(f"{does_not_fit} (--memory), and the model has no layers or blocks to time fewer of")
    # The two depths' difference is multiplied by the depth: each the best of three steps, however long.
    micro, at = None, {}
    for depth in REDUCED_DEPTHS:
        step = worker_step(planned.task, cfg, indices, depth, shape.depth_key, device)
        micro = micro or micro_batch(step, batch, device)[0]
        at[depth] = timed(step(micro), device, budget=math.inf) * batch / micro
        del step  # and its model, before the next is built
    deep, shallow = REDUCED_DEPTHS
    seconds = at[shallow] + max(0.0, (at[deep] - at[shallow]) / (deep - shallow)) * (shape.depth - shallow)
    return WorkerTime(seconds, f"{does_not_fit}: depths {deep} and {shallow} of {shape.depth} timed, scaled "
                               f"linearly in depth; {_micro_note(micro, batch)}")


def _micro_note(micro: int, batch: int) -> str:
    return "measured" if micro == batch else f"micro-batch {micro} of {batch}, x{batch / micro:g}"


def time_method(cfg: DictConfig, method: Method, workers: int, numel: int, epoch: float,
                device: torch.device) -> float:
    """The method's step for `workers` workers' gradients, timed on a stand-in of min(numel, STAND_IN) parameters
    (four layers: per-layer rules such as TernGrad's scalers apply) and scaled linearly to `numel`."""
    rows = max(1, min(numel, STAND_IN) // (4 * 1025))
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        module = nn.Sequential(*(nn.Linear(1024, rows) for _ in range(4))).to(getattr(torch, cfg.train.dtype))
    flat = FlatParams(module)
    cluster_cfg = OmegaConf.merge(cfg.cluster, {"backend": "simulated", "workers": workers})
    cluster = build_cluster(cluster_cfg, method, flat, cfg.seed, cfg.train.nonfinite, cfg.train.master_weights)
    grads = {d: torch.randn(workers, b.numel(), device=device).to(d) for d, b in flat.buffers.items()}
    steps = iter(range(10))
    seconds = timed(lambda: cluster.step(grads, step=next(steps), lr=method.lr, epoch=epoch), device)
    return seconds * numel / flat.numel


# --- the estimate -----------------------------------------------------------------------------------------------


@dataclass
class Estimate:
    """A spec's runs grouped into rows, the worker timings they rest on, and where they were timed."""

    name: str
    sections: list[str]
    rows: list[Row]
    timings: list[tuple[str, WorkerTime]]  # ("task / model (per-worker batch)", its timing)
    devices: set[str]
    notes: list[str]

    def hours(self, section: str | None = None) -> float:
        return sum(r.hours for r in self.rows if section in (None, r.section))

    def runs(self, section: str | None = None) -> int:
        return sum(r.runs for r in self.rows if section in (None, r.section))

    def text(self) -> str:
        rows = [[r.section, r.group, str(r.runs), f"{r.steps:,}", _cell(r.seconds), str(r.devices), _cell(r.hours)]
                for r in self.rows]
        for name in [*self.sections, None]:
            rows.append([f"**{name or 'total'}**", "", str(self.runs(name)), "", "", "", _cell(self.hours(name))])
        timings = [[what, _cell(t.seconds), t.how] for what, t in self.timings]
        return "\n".join([
            f"# Estimate: {self.name} on {', '.join(sorted(self.devices))}", "",
            _table(["section", "group", "runs", "steps/run", "s/step", "devices", "device-hours"], rows), "",
            "One worker's forward + backward (s) on its whole batch:", "",
            _table(["task / model (per-worker batch)", "s", "how"], timings), "",
            "s/step: simulated cluster = N x one worker's forward + backward + the method's step (timed on a "
            f"{STAND_IN / 2**20:g} Mi-parameter stand-in with N workers' gradients, scaled linearly to the model's "
            "parameters); torchdist = one worker's forward + backward + its method arithmetic, on each of N devices, "
            "the exchange over the network not included. device-hours = runs x steps x s/step x devices / 3600. "
            "Not counted: evaluations, few-shot evaluation, checkpoints, torch.compile.",
            *[f"Note: {note}." for note in self.notes]])


def _cell(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in [header, *rows]]
    return "\n".join([lines[0], "| " + " | ".join("-" * w for w in widths) + " |", *lines[1:]])


def _model_name(cfg: DictConfig, choice: str) -> str:
    """The model's config name, and a pretrained model's source (a hub id, or a folder's last two parts)."""
    source = cfg.model.get("pretrained")
    if not source:
        return choice
    return f"{choice} {source if str(source).startswith('hub:') else '/'.join(Path(str(source)).parts[-2:])}"


@dataclass
class _Caches:
    """What runs share: the planned data and steps (by `plan_key`), one worker's timing (by task, model, batch,
    device and precision) and the method's step (by method settings but lr and weight decay, workers, size)."""

    memory_gib: float | None
    planned: dict[str, Planned] = field(default_factory=dict)
    workers: dict[tuple, tuple[str, WorkerTime]] = field(default_factory=dict)  # key -> (what, its timing)
    methods: dict[tuple, float] = field(default_factory=dict)
    untimed: set[str] = field(default_factory=set)  # methods only torchrun runs (DDP's): their step is not timed

    def plan(self, cfg: DictConfig, method: Method) -> Planned:
        key = plan_key(cfg)
        if key not in self.planned:
            self.planned[key] = plan(cfg, method)
        return self.planned[key]

    def worker(self, name: str, planned: Planned, cfg: DictConfig, device: torch.device) -> WorkerTime:
        key = (OmegaConf.to_yaml(cfg.task), OmegaConf.to_yaml(cfg.model), cfg.cluster.per_worker_batch, str(device),
               cfg.train.dtype, cfg.train.get("amp"), cfg.train.get("threads"))
        if key not in self.workers:
            memory = int(self.memory_gib * 2**30) if self.memory_gib is not None else free_memory(device)
            self.workers[key] = (name, time_worker(planned, cfg, device, memory))
        return self.workers[key][1]

    def method(self, cfg: DictConfig, method: Method, stepping: int, planned: Planned, device: torch.device) -> float:
        epochs = planned.steps / planned.sampler.steps_per_epoch
        hparams = tuple(sorted((k, str(v)) for k, v in method.hparams().items() if k not in ("lr", "weight_decay")))
        key = (method.name, hparams, stepping, planned.shape.numel, str(device), cfg.train.dtype, epochs)
        if key not in self.methods:
            if "simulated" in method.backends:
                self.methods[key] = time_method(cfg, method, stepping, planned.shape.numel, epochs / 2, device)
            else:
                self.methods[key] = 0.0
                self.untimed.add(variant_of(method.name, method.hparams()).label)
        return self.methods[key]


def estimate(spec: dict[str, Any], tuning: Tuning | None, extra: list[str], conf_dir: Path, runs_dir: Path,
             memory_gib: float | None = None) -> Estimate:
    """The spec's estimate (see the module's docstring). Raises what a run would: a bad setting, absent data (the
    loaders' one error line); or a model too large to time that has no depth to reduce."""
    from hydra import compose, initialize_config_dir

    parts, note = spec_sections(spec, tuning, runs_dir)
    result = Estimate(spec["name"], [name for name, _ in parts], [], [], set(), [note] if note else [])
    caches, rows = _Caches(memory_gib), {}
    with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base="1.3"):
        for section, part in parts:
            for point in run_points(part, extra):
                cfg = compose("config", overrides=point, return_hydra_config=True)
                choices = dict(cfg.hydra.runtime.choices)
                with open_dict(cfg):
                    del cfg["hydra"]
                row = _row(section, cfg, choices, caches, result)
                rows.setdefault((row.section, row.group, row.steps, row.seconds), row).runs += 1
    result.rows = sorted(rows.values(), key=lambda r: (r.order, r.group))
    result.timings = list(caches.workers.values())
    if caches.untimed:
        result.notes.append(f"{', '.join(sorted(caches.untimed))}: only torchrun runs them, so their step is not "
                            "timed here: their s/step is the forward + backward alone")
    return result


def _row(section: str, cfg: DictConfig, choices: dict[str, str], caches: _Caches, result: Estimate) -> Row:
    """One run's row (runs=0): its group, steps, and seconds per step on its device."""
    method = validate(cfg)
    device = resolve_device(cfg.train.get("device", "auto"))
    threads = cfg.train.get("threads") if device.type == "cpu" else None
    result.devices.add(describe(device) + (f" ({threads} torch thread{'s' * (threads != 1)} a run)" if threads else ""))
    planned = caches.plan(cfg, method)
    method.check_run(planned.steps / planned.sampler.steps_per_epoch)  # build_run's check, for every method
    batch, n = int(cfg.cluster.per_worker_batch), int(cfg.cluster.workers)
    simulated = cfg.cluster.backend == "simulated"
    what = f"{choices['task']} / {_model_name(cfg, choices['model'])}"
    stepping = n if simulated else 1  # the workers whose gradients and rules one process computes
    seconds = (stepping * caches.worker(f"{what} ({batch})", planned, cfg, device).seconds
               + caches.method(cfg, method, stepping, planned, device))
    label = variant_of(method.name, method.hparams()).label
    return Row(section, f"{what}, N={n}{'' if simulated else ' ranks'} x {batch}, {label}", planned.steps, seconds,
               1 if simulated else n, order=(result.sections.index(section), what, n, batch, label_order(label)))


def main_estimate(spec: dict[str, Any], tuning: Tuning | None, extra: list[str], conf_dir: Path, runs_dir: Path,
                  memory_gib: float | None) -> int:
    """`distlion-experiment SPEC --estimate`: print the estimate; 0, or 1 after one `distlion: error:` line."""
    try:
        print(estimate(spec, tuning, extra, conf_dir, runs_dir, memory_gib).text(), flush=True)
    except Exception as err:
        reason = error_line(err)
        if reason is None:
            raise
        print(f"distlion: error: {spec['name']}: {reason}", file=sys.stderr)
        return 1
    return 0
