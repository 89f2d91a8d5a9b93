"""The wall-clock report of a spec run on links (`netem:` in the spec; issue 14).

From the runs of each method on each link (`cluster.link`, measured under distlion-netem):

- the step time by phase, measured;
- the cost model (`distlion.costmodel`) calibrated on each method's run on the reference link (uncapped),
  its predicted step time on the other links against the measured one;
- time to the validation target on each link: a run's steps are the same computation on every link (the
  link changes when bytes arrive, not what they are), so the steps to target come from the longest run of the
  method (on the reference link) and the seconds from the measured step time on each link;
- accuracy against wall-clock time per link, and the same curves redrawn at links no run used;
- a model prediction past this machine: D-Lion's speedup over bf16 DDP and PowerSGD for ViT-B/16 and a 7B
  LLaMA at 8-64 workers on 10-400 Gbit/s, from cited per-GPU compute times.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

from distlion.costmodel import Link, Transfer, calibrate, comm_seconds, transfers
from distlion.report import (
    Run,
    chart_points,
    curve_metric,
    first_reaching,
    group_runs,
    legend_text,
    line_styles,
    load_runs,
    mean_curve,
    save_plot,
    steady_phase_times,
    varying_keys,
)
from distlion.tasks.base import Metric

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REFERENCE = "none"


def link_rate(link: str) -> float | None:
    """Bits/s of a tc rate string (None: uncapped)."""
    from distlion.netem import parse_rate

    return parse_rate(link)


def by_method_and_link(runs: list[Run]) -> dict[tuple[str, str], list[Run]]:
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r["label"], r.get("link") or REFERENCE), []).append(r)
    return groups


def measured_step(members: list[Run]) -> float:
    """Mean seconds per step over the runs' logged steps after start-up (`report.steady_phase_times`)."""
    return statistics.fmean(steady_phase_times(r)["time_step"] for r in members)


def reference_link(runs: list[Run]) -> Link:
    """The uncapped link as its runs measured it (the link check before each), latency in the calibration."""
    measured = [r["link_measured"] for r in runs
                if (r.get("link") or REFERENCE) == REFERENCE and r.get("link_measured")]
    return Link(statistics.fmean(measured) if measured else None)


def link_of(name: str) -> Link:
    """A capped link at its rate; TCP payload gets 1448 of every 1514 bytes on the wire (measured: 95.6%)."""
    rate = link_rate(name)
    return Link(None if rate is None else rate * 1448 / 1514)


def validation_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """Per method and capped link: measured and predicted seconds per step and the model's error."""
    groups = by_method_and_link(runs)
    reference = reference_link(runs)
    rows = []
    for (label, link), members in sorted(groups.items()):
        base = groups.get((label, REFERENCE))
        if base is None:
            continue
        calibration = calibrate(Path(base[0]["run_dir"]))
        predicted = calibration.step(link_of(link) if link != REFERENCE else reference, reference)["step"]
        measured = measured_step(members)
        rows.append({"method": label, "link": link, "measured": measured, "predicted": predicted,
                     "error": predicted / measured - 1})
    return rows


@dataclass
class ToTarget:
    label: str
    steps: int | None
    seconds: dict[str, float | None]


def time_to_target(runs: list[Run], metric: Metric, value: float) -> list[ToTarget]:
    """Per method: the steps its longest run needed to reach `value`, and the seconds on each link."""
    groups = by_method_and_link(runs)
    links = sorted({link for _, link in groups}, key=lambda x: link_rate(x) or math.inf)
    out = []
    for label in sorted({label for label, _ in groups}):
        longest = max((r for (lab, _), ms in groups.items() if lab == label for r in ms), key=lambda r: r["steps"])
        reached = first_reaching(longest["curve"], metric.key, value, metric.higher_is_better)
        steps = reached["step"] if reached else None
        seconds = {link: (steps * measured_step(groups[(label, link)]) if steps and (label, link) in groups else None)
                   for link in links}
        out.append(ToTarget(label, steps, seconds))
    return out


def plot_accuracy_vs_time(runs: list[Run], path: Path, predicted: tuple[str, ...] = ()) -> None:
    """The validation metric of each method's longest run against the seconds its steps take on each link:
    measured step times on the links the runs used, the cost model's on the `predicted` links."""
    groups = by_method_and_link(runs)
    measured = sorted({link for _, link in groups}, key=lambda x: link_rate(x) or math.inf)
    panels = [(link, False) for link in measured] + [(link, True) for link in predicted if link not in measured]
    metric = curve_metric(runs)
    reference = reference_link(runs)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False, sharey=True)
    for ax, (link, modelled) in zip(axes[0], panels, strict=True):
        for label in sorted({lab for lab, _ in groups}):
            longest = max((r for (lab, _), ms in groups.items() if lab == label for r in ms), key=lambda r: r["steps"])
            if modelled and (label, REFERENCE) in groups:
                model = calibrate(Path(groups[(label, REFERENCE)][0]["run_dir"]))
                step_s = model.step(link_of(link), reference)["step"]
            elif not modelled and (label, link) in groups:
                step_s = measured_step(groups[(label, link)])
            else:
                continue
            points = [p for p in longest["curve"] if metric.key in p]
            ax.plot([p["step"] * step_s for p in points], [metric.scale * p[metric.key] for p in points],
                    marker="o", markersize=3, label=label)
        ax.set_title(f"link {link}: steps x {'modelled' if modelled else 'measured'} step time", fontsize=9)
        ax.set_xlabel("training time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric.display)
    axes[0][-1].legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------
# Simulated runs on links they never used: their measured compute and codecs, the cost model's communication.

def rank_compute(run: Run) -> float:
    """Seconds of forward and backward per step of one rank: a simulated run computed all N workers' gradients in
    one process, so its measured compute is divided by N."""
    workers = run["workers"] if run.get("backend", "simulated") == "simulated" else 1
    return steady_phase_times(run)["time_compute"] / workers


def modelled_step(run: Run, link: Link, compute: float | None = None) -> float:
    """Seconds per step of one rank of a run on `link`: forward and backward (`compute`, else the run's own
    `rank_compute`), its encode (a simulated run's for all N workers, divided by N), its in-process server rule
    and update, plus the collectives of its exchange for the bits it sent, at the link's bandwidth and latency. A
    method that syncs every H steps pays its exchanges spread over the run's steps (its `syncs`: every H-th step,
    and the last with `train.final_sync`; runs made before that count was recorded synced every H-th only)."""
    times = steady_phase_times(run)
    workers = run["workers"] if run.get("backend", "simulated") == "simulated" else 1
    compute = rank_compute(run) if compute is None else compute
    syncs_per_step = 1.0
    if run.get("method.sync_every"):
        syncs_per_step = run.get("syncs", run["steps"] // run["method.sync_every"]) / run["steps"]
    comm = 0.0
    if syncs_per_step:  # (a run shorter than H that never synced sent nothing)
        n = run["num_params"]
        steps = transfers(run["exchange"], run["bits_up_per_param_per_iter"] / syncs_per_step * n,
                          run["bits_down_per_param_per_iter"] / syncs_per_step * n, run["workers"])
        comm = comm_seconds(steps, run["workers"], link) * syncs_per_step
    return compute + times["time_encode"] / workers + times["time_comm"] + times["time_apply"] + comm


def shape_compute(runs: list[Run]) -> dict[tuple, float]:
    """One rank's forward and backward seconds per step per task, worker count and batch: every method runs the same
    ones, and the median over the runs keeps a run slowed by another process on the shared cores from looking slow."""
    by_shape: dict[tuple, list[float]] = {}
    for r in runs:
        by_shape.setdefault((r["task"], r["workers"], r["per_worker_batch"]), []).append(rank_compute(r))
    return {shape: statistics.median(seconds) for shape, seconds in by_shape.items()}


def modelled_points(runs: list[Run], link: str) -> list[dict[str, Any]]:
    """Per group: the final headline metric (mean, std, n) against the modelled training time of its runs on `link`
    (steps x modelled seconds per step, mean over seeds), for the interactive chart (`distlion.pages`)."""
    compute = shape_compute(runs)

    def seconds(members: list[Run]) -> float:
        return statistics.fmean(r["steps"] * modelled_step(r, link_of(link), compute[(r["task"], r["workers"],
                                                                                      r["per_worker_batch"])])
                                for r in members)

    return chart_points(runs, seconds)


def write_modelled(runs: list[Run], out: Path, links: list[str]) -> str:
    """`modelled_time.md` and one plot per link: each group's modelled seconds per step, and its validation metric
    (mean over seeds) against modelled training time. Returns the Markdown."""
    metric = curve_metric(runs)
    keys = varying_keys(runs)
    groups = group_runs(runs, keys)
    compute = shape_compute(runs)

    def seconds(r: Run, link: str) -> float:
        return modelled_step(r, link_of(link), compute[(r["task"], r["workers"], r["per_worker_batch"])])

    lines = ["# Modelled wall-clock\n",
             "Seconds per step of one rank on links these simulated runs never used: forward and backward (the "
             "median over this report's runs of the same task, worker count and batch, per rank: the simulated "
             "process computed all N workers, so its time / N; the same for every method), each run's own encode "
             "(/ N), server rule and update as measured on this machine's CPU, plus the cost model's collectives "
             "(`distlion.costmodel`, alpha = 0) for the bits each method sent, once per sync for methods that sync "
             "every H steps. A model, not a measurement: `results/wallclock_cpu/` checks the cost model against "
             "emulated links.\n",
             "| run | rank compute (s/step) | " + " | ".join(f"{link} (s/step)" for link in links) + " |",
             "|---|---:|" + "---:|" * len(links)]
    for values, members in groups.items():
        shape = (members[0]["task"], members[0]["workers"], members[0]["per_worker_batch"])
        cells = [f"{statistics.fmean(seconds(r, link) for r in members):.4f}" for link in links]
        lines.append(f"| {legend_text(keys, values)} | {compute[shape]:.4f} | " + " | ".join(cells) + " |")
    styles = line_styles(keys, groups)  # the other plots' colour per method, so dozens of groups stay legible
    for link in links:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for values, members in groups.items():
            steps, means, _ = mean_curve(members, "step", metric.key)
            per_step = statistics.fmean(seconds(r, link) for r in members)
            ax.plot([s * per_step for s in steps], [metric.scale * m for m in means], markersize=3, lw=1,
                    markevery=max(1, len(steps) // 10), label=legend_text(keys, values), **styles[values])
        save_plot(fig, ax, out / f"metric_vs_modelled_time_{link}.png",
                  f"modelled training time on {link} links (s)", metric.display)
        lines.append(f"\n![{metric.display} against modelled time, {link}](metric_vs_modelled_time_{link}.png)")
    markdown = "\n".join(lines) + "\n"
    (out / "modelled_time.md").write_text(markdown)
    return markdown


# ------------------------------------------------------------------------------------------------------
# Past this machine: a model prediction from cited per-GPU compute times.

@dataclass(frozen=True)
class Workload:
    """A model trained data-parallel: parameters, its PowerSGD payload, and one worker's compute per step."""

    name: str
    params: float
    powersgd_entries: float  # entries PowerSGD (rank 4) all-reduces per step: factors + uncompressed tensors
    compute_s: float
    source: str


def powersgd_entries(shapes: list[tuple[int, ...]], rank: int = 4) -> int:
    """Entries torch's PowerSGD all-reduces for these gradient shapes (its rule: factors when under half)."""
    entries = 0
    for shape in shapes:
        rows, numel = shape[0], math.prod(shape)
        cols = numel // rows
        r = min(rows, cols, rank)
        compress = len(shape) > 1 and (rows + cols) * r * 2 < numel
        entries += (rows + cols) * r if compress else numel
    return entries


def transformer_shapes(layers: int, width: int, hidden: int, vocab: int, extra: int = 0) -> list[tuple[int, ...]]:
    """Gradient shapes of a pre-norm transformer: attention (4 width x width), MLP, norms, embeddings."""
    mlp = [(hidden, width), (width, hidden)] if extra == 0 else [(hidden, width)] * 2 + [(width, hidden)]
    block = [(width, width)] * 4 + mlp + [(width,), (width,)]
    return [s for _ in range(layers) for s in block] + [(vocab, width)]


def workloads() -> list[Workload]:
    vit = transformer_shapes(12, 768, 3072, 1000)
    llama = transformer_shapes(32, 4096, 11008, 32000, extra=1) + [(32000, 4096)]
    return [
        Workload("ViT-B/16 (86M), 128 images/worker", 86.6e6, powersgd_entries(vit), 128 / 252,
                 "DeiT-B: 300 ImageNet epochs in 53 h on 8 V100 (Touvron et al. 2021) = 252 images/s/GPU"),
        Workload("LLaMA 7B, 16k tokens/worker", 6.74e9, powersgd_entries(llama), 16384 / 3014,
                 "Llama 2 7B: 2.0T tokens in 184,320 A100-80GB hours (Touvron et al. 2023, Table 2) "
                 "= 3,014 tokens/s/GPU"),
    ]


#: HBM bandwidth of an A100 (1.5 TB/s, 40 GB): the codecs are memory-bound elementwise passes.
HBM_BYTES_PER_S = 1.5e12
#: Latency per collective round on a datacenter network (RDMA/NCCL order of magnitude; an assumption).
ALPHA_S = 10e-6


def scale_step(method: str, load: Workload, workers: int, gbit: float) -> float:
    """Predicted seconds per step. DDP overlaps its all-reduce with backward (2/3 of compute) but for the last
    25 MB bucket; so does D-Lion's DDP-hook form (`dlion_ddp`: the same exchange per bucket), while `dlion`
    exchanges after backward, not overlapped."""
    n, link = load.params, Link(gbit * 1e9, ALPHA_S)
    buckets = max(1, math.ceil(4 * n / 25e6))
    if method in ("dlion", "dlion_ddp"):
        codec = 25 * n / HBM_BYTES_PER_S  # read m, g, x; write m, x; packed signs
        if method == "dlion":
            steps = [Transfer("all_to_all", n / 8), Transfer("all_gather", n / 8 / workers)]
            return load.compute_s + codec + comm_seconds(steps, workers, link)
        steps = [Transfer("all_to_all", n / 8, calls=buckets), Transfer("all_gather", n / 8 / workers, calls=buckets)]
        comm = comm_seconds(steps, workers, link)
    else:
        payload = {"ddp_bf16": 2 * n, "powersgd": 4 * load.powersgd_entries}[method]
        comm = comm_seconds([Transfer("all_reduce", payload, calls=buckets)], workers, link)
        codec = (6 if method == "ddp_bf16" else 20) * n / HBM_BYTES_PER_S
    exposed = max(comm - 2 / 3 * load.compute_s, comm / buckets)
    return load.compute_s + codec + exposed


def scale_table(method: str = "dlion", workers: tuple[int, ...] = (8, 16, 64),
                gbits: tuple[float, ...] = (10, 25, 100, 400)) -> str:
    """`method`'s (dlion or dlion_ddp) predicted speedup over bf16 DDP / over PowerSGD, per model, N and link."""
    lines = ["| model | N | " + " | ".join(f"{g:g} Gbit/s" for g in gbits) + " |",
             "|---|---:|" + "---:|" * len(gbits)]
    for load in workloads():
        for n in workers:
            cells = []
            for g in gbits:
                ours = scale_step(method, load, n, g)
                cells.append(f"{scale_step('ddp_bf16', load, n, g) / ours:.2f}x / "
                             f"{scale_step('powersgd', load, n, g) / ours:.2f}x")
            lines.append(f"| {load.name} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def workload_notes() -> str:
    """Where each workload's compute time comes from, and PowerSGD's share of its entries."""
    return "\n".join(f"- {load.name}: {load.source}; PowerSGD rank 4 sends "
                     f"{load.powersgd_entries / load.params:.2%} of the entries." for load in workloads()) + "\n"


def write(runs_dir: Path, out: Path, metric_value: float | None = None) -> str:
    """results/<spec>/wallclock.md and its plot; returns the Markdown."""
    runs = load_runs(runs_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = ["# Wall-clock\n"]
    rows = validation_rows(runs)
    if rows:
        parts.append("Seconds per step, measured under distlion-netem and predicted by the cost model calibrated "
                     "on each method's run on the uncapped link:\n\n| method | link | measured (s) | predicted (s) "
                     "| error |\n|---|---|---:|---:|---:|")
        parts += [f"| {r['method']} | {r['link']} | {r['measured']:.3f} | {r['predicted']:.3f} | {r['error']:+.0%} |"
                  for r in rows]
        parts.append("")
    if metric_value is not None:
        metric = curve_metric(runs)
        table = time_to_target(runs, metric, metric_value)
        links = list(table[0].seconds) if table else []
        parts.append(f"Time to {metric.display} {metric.scale * metric_value:.{metric.decimals}f}: the steps of the "
                     "method's longest run to the target, times its measured step time on each link:\n")
        parts.append("| method | steps | " + " | ".join(f"{link} (s)" for link in links) + " |")
        parts.append("|---|---:|" + "---:|" * len(links))
        for t in table:
            cells = [f"{s:.0f}" if s is not None else "not reached" for s in t.seconds.values()]
            parts.append(f"| {t.label} | {t.steps if t.steps is not None else 'not reached'} | "
                         + " | ".join(cells) + " |")
        parts.append("")
    plot_accuracy_vs_time(runs, out / "accuracy_vs_time.png", predicted=("10mbit",))
    parts.append("![accuracy against training time per link](accuracy_vs_time.png)\n\nThe last panel redraws the "
                 "curves at a link no run used (10 Mbit/s), with the cost model's step times.\n")
    parts.append("A model prediction past this machine: D-Lion MaVo's speedup in step time over bf16 DDP / over "
                 "PowerSGD (rank 4), alpha-beta on a switched network (alpha 10 us per round), codecs memory-bound "
                 "on an A100's 1.5 TB/s. Exchanged after backward (`dlion`):\n")
    parts.append(scale_table("dlion"))
    parts.append("Exchanged per DDP bucket during backward (`dlion_ddp`), hidden as DDP's all-reduce is:\n")
    parts.append(scale_table("dlion_ddp"))
    parts.append(workload_notes())
    markdown = "\n".join(parts)
    (out / "wallclock.md").write_text(markdown)
    return markdown


def main() -> None:
    """`python -m distlion.wallclock RUNS_DIR OUT [--link 10gbit ...]`: redraw finished runs' accuracy against
    training time at any link, from their measured steps and the cost model calibrated on their step times."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("runs", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--link", action="append", default=[], help="a tc rate to redraw at (repeatable)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plot_accuracy_vs_time(load_runs(args.runs), args.out / "accuracy_vs_time.png", predicted=tuple(args.link))
    print(f"wrote {args.out / 'accuracy_vs_time.png'}")


if __name__ == "__main__":
    main()
