"""Tables and plots from finished runs: `distlion-report runs/demo --out results/demo`.

Reads every `summary.json` (and its `metrics.jsonl`) under a sweep directory, groups runs that
differ only by seed (mean ± std over seeds, with n), and writes a Markdown table, a CSV of every
run, and PNG plots: test metric against cumulative communicated bits per parameter, and against
the number of workers.
"""

from __future__ import annotations

import argparse
import csv
import html
import json
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_LABELS = {"adamw": "G-AdamW", "lion": "G-Lion", "terngrad": "TernGrad", "dgc": "DGC", "graddrop": "GradDrop"}
_ORDER = ["G-AdamW", "G-Lion", "TernGrad", "GradDrop", "DGC", "D-Lion (Avg)", "D-Lion (MaVo)"]


def method_label(summary: dict[str, Any]) -> str:
    """The paper's name for a run's method."""
    if summary["method"] == "dlion":
        return "D-Lion (MaVo)" if summary.get("method.aggregation") == "mavo" else "D-Lion (Avg)"
    return _LABELS.get(summary["method"], summary["method"])


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Every finished run under `root`, with its metrics curve under the key "curve"."""
    runs = []
    for path in sorted(root.rglob("summary.json")):
        summary = json.loads(path.read_text())
        metrics = path.parent / "metrics.jsonl"
        summary["curve"] = (
            [json.loads(line) for line in metrics.read_text().splitlines() if line] if metrics.exists() else []
        )
        summary["run_dir"] = str(path.parent)
        summary["label"] = method_label(summary)
        runs.append(summary)
    if not runs:
        raise FileNotFoundError(f"no finished run (summary.json) under {root}; run the sweep first")
    return runs


def _sort_key(label: str) -> tuple[int, str]:
    return (_ORDER.index(label) if label in _ORDER else len(_ORDER), label)


def group_runs(runs: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Runs grouped by (method label, workers, per-worker batch); seeds are the members."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[(r["label"], r["workers"], r["per_worker_batch"])].append(r)
    return dict(sorted(groups.items(), key=lambda kv: (_sort_key(kv[0][0]), kv[0][1], kv[0][2])))


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def _fmt_metric(metric: str, values: list[float]) -> str:
    if metric == "eval_accuracy":
        scaled = [100 * v for v in values]
        return (
            f"{scaled[0]:.2f}"
            if len(scaled) == 1
            else f"{statistics.mean(scaled):.2f} ± {statistics.stdev(scaled):.2f}"
        )
    return _mean_std(values)


def markdown_table(runs: list[dict[str, Any]]) -> str:
    metric = runs[0]["metric"]
    name = "test accuracy (%)" if metric == "eval_accuracy" else metric.replace("eval_", "validation ")
    perplexity = "eval_perplexity" in runs[0]  # language models: loss and exp(loss)
    lines = [
        f"| method | workers | per-worker batch | {name} |{' perplexity |' if perplexity else ''} n "
        "| bits/param/iter up | down | total | total bits communicated | steps | wall time (min) |",
        "|---|---:|---:|---:|" + ("---:|" if perplexity else "") + "---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (label, workers, batch), members in group_runs(runs).items():
        r = members[0]
        ppl = f" {_mean_std([m['eval_perplexity'] for m in members])} |" if perplexity else ""
        lines.append(
            f"| {label} | {workers} | {batch} | {_fmt_metric(metric, [m[metric] for m in members])} |{ppl} "
            f"{len(members)} "
            f"| {r['bits_up_per_param_per_iter']:.3f} | {r['bits_down_per_param_per_iter']:.3f} "
            f"| {r['bits_per_param_per_iter']:.3f} | {statistics.mean(m['total_bits'] for m in members):.3e} "
            f"| {r['steps']} | {statistics.mean(m['wall_time'] for m in members) / 60:.1f} |"
        )
    reference = runs[0].get("unigram_entropy")
    if reference is not None:
        lines.append(f"\nReference: the unigram entropy of the tokenizer's training data, {reference:.3f} nats/token "
                     "(the validation loss of the best model that ignores context).")
    return "\n".join(lines) + "\n"


def pivot_table(runs: list[dict[str, Any]], columns: str = "workers") -> str:
    """The paper's layout: one row per method, one column per value of `columns` (mean ± std, n)."""
    metric = runs[0]["metric"]
    values = sorted({r[columns] for r in runs})
    cells: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        cells[r["label"]][r[columns]].append(r[metric])
    lines = [f"| method | {' | '.join(f'{columns}={v}' for v in values)} |", "|---|" + "---:|" * len(values)]
    for label in sorted(cells, key=_sort_key):
        row = [
            f"{_fmt_metric(metric, cells[label][v])} (n={len(cells[label][v])})" if cells[label][v] else "—"
            for v in values
        ]
        lines.append(f"| {label} | {' | '.join(row)} |")
    return "\n".join(lines) + "\n"


def hparams_table(runs: list[dict[str, Any]]) -> str:
    """The hyperparameters each method actually ran with, read from the runs' summaries."""
    lines = ["| method | lr | settings |", "|---|---:|---|"]
    seen = set()
    for r in sorted(runs, key=lambda r: _sort_key(r["label"])):
        settings = ", ".join(
            f"{k.removeprefix('method.')}={v}" for k, v in sorted(r.items()) if k.startswith("method.")
        )
        row = f"| {r['label']} | {r['lr']:g} | {settings} |"
        if row not in seen:
            seen.add(row)
            lines.append(row)
    return "\n".join(lines) + "\n"


_CSV_FIELDS = [
    "label",
    "method",
    "workers",
    "per_worker_batch",
    "seed",
    "steps",
    "epochs",
    "eval_accuracy",
    "eval_loss",
    "eval_perplexity",
    "unigram_entropy",
    "bits_up_per_param_per_iter",
    "bits_down_per_param_per_iter",
    "bits_per_param_per_iter",
    "cum_bits_per_param",
    "total_bits",
    "num_params",
    "wall_time",
    "config_hash",
    "git_sha",
    "run_dir",
]


def write_csv(runs: list[dict[str, Any]], path: Path) -> None:
    """One row per run; run_dir relative to the CSV's folder, so a committed CSV names no machine's paths."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in sorted(runs, key=lambda r: (_sort_key(r["label"]), r["workers"], r["seed"])):
            writer.writerow({**r, "run_dir": os.path.relpath(r["run_dir"], path.parent)})


def _colors(labels: list[str]) -> dict[str, Any]:
    cmap = plt.get_cmap("tab10")
    return {label: cmap(i % 10) for i, label in enumerate(sorted(set(labels), key=_sort_key))}


def _reference_line(ax: Any, runs: list[dict[str, Any]]) -> None:
    """The unigram-entropy line of language-model runs: the loss that ignores context."""
    if runs[0]["metric"] == "eval_loss" and runs[0].get("unigram_entropy") is not None:
        ax.axhline(runs[0]["unigram_entropy"], color="gray", ls="--", lw=1, label="unigram entropy")


def _metric_name(metric: str) -> str:
    return {"eval_accuracy": "test accuracy", "eval_loss": "validation loss (nats/token)"}.get(metric, metric)


def _save(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, **legend: Any) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, **legend)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_curves(runs: list[dict[str, Any]], path: Path, x: str, y: str, xlabel: str, ylabel: str,
                 log_x: bool = False, reference: bool = False, **line: Any) -> None:
    """One line per (method, workers) through the first seed's logged (x, y) points."""
    colors = _colors([r["label"] for r in runs])
    worker_counts = sorted({r["workers"] for r in runs})
    styles = dict(zip(worker_counts, ["-", "--", ":", "-."] * 4))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (label, workers, _), members in group_runs(runs).items():
        points = [(p[x], p[y]) for p in members[0]["curve"] if y in p]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, styles[workers], color=colors[label], label=f"{label}, N={workers}", **line)
    if reference:
        _reference_line(ax, runs)
    if log_x:
        ax.set_xscale("log")
    _save(fig, ax, path, xlabel, ylabel, ncol=2)


def plot_metric_curves(runs: list[dict[str, Any]], path: Path) -> None:
    """The evaluated metric against training steps, one line per (method, workers), first seed."""
    metric = runs[0]["metric"]
    _plot_curves(runs, path, "step", metric, "step", _metric_name(metric), reference=True, marker=".")


def plot_metric_vs_bits(runs: list[dict[str, Any]], path: Path) -> None:
    """Test metric against cumulative bits per parameter (uplink + downlink, per worker), log x."""
    metric = runs[0]["metric"]
    _plot_curves(runs, path, "cum_bits_per_param", metric,
                 "cumulative bits per parameter communicated per worker (up + down)", _metric_name(metric),
                 log_x=True, reference=True, marker=".")


def plot_loss_curves(runs: list[dict[str, Any]], path: Path) -> None:
    """Train loss against epochs, one line per (method, workers), first seed."""
    _plot_curves(runs, path, "epoch", "train_loss", "epoch", "train loss", lw=1)


def plot_metric_vs_bits_per_iter(runs: list[dict[str, Any]], path: Path) -> None:
    """The paper's figure: final metric against bits per parameter per iteration (up + down), log x."""
    metric = runs[0]["metric"]
    colors = _colors([r["label"] for r in runs])
    worker_counts = sorted({r["workers"] for r in runs})
    markers = dict(zip(worker_counts, "os^Dv<>p" * 2))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for (label, workers, _), members in group_runs(runs).items():
        values = [m[metric] for m in members]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        ax.errorbar(members[0]["bits_per_param_per_iter"], statistics.mean(values), yerr=spread, ls="none",
                    marker=markers[workers], color=colors[label], capsize=3, label=f"{label}, N={workers}")
    _reference_line(ax, runs)
    ax.set_xscale("log", base=2)
    # The legend goes outside: the points fill the axes.
    _save(fig, ax, path, "bits per parameter per iteration (worker -> server + server -> worker)",
          _metric_name(metric), loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_metric_vs_workers(runs: list[dict[str, Any]], path: Path) -> None:
    metric = runs[0]["metric"]
    by_label: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for (label, workers, _), members in group_runs(runs).items():
        values = [m[metric] for m in members]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        by_label[label].append((workers, statistics.mean(values), spread))
    colors = _colors(list(by_label))
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in by_label.items():
        xs, ys, es = zip(*sorted(points))
        ax.errorbar(xs, ys, yerr=es, color=colors[label], marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    _save(fig, ax, path, "workers", _metric_name(metric))


def write_report(
    root: Path, out: Path, command: str | None = None, columns: str | None = None, notes: str | None = None
) -> list[dict[str, Any]]:
    """Tables, CSV, plots and a static HTML page for the runs under `root`, written into `out`."""
    runs = load_runs(root)
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"# Results: {out.name}\n"]
    if notes:
        parts.append(notes.strip() + "\n")
    if command:
        parts.append(f"Produced by:\n\n```\n{command}\n```\n")
    seeds = sorted({r["seed"] for r in runs})
    parts.append(
        f"{len(runs)} runs, seeds {seeds}; the metric comes from a real evaluation on the held-out split "
        "at the end of training; bits are counted from the messages each method built.\n"
    )
    if columns:
        parts.append(pivot_table(runs, columns))
    parts.append(markdown_table(runs))
    parts.append("Hyperparameters, as run:\n\n" + hparams_table(runs))
    plot_metric_vs_bits(runs, out / "metric_vs_bits.png")
    plot_metric_vs_bits_per_iter(runs, out / "metric_vs_bits_per_iter.png")
    plot_metric_curves(runs, out / "metric_curves.png")
    plot_loss_curves(runs, out / "loss_curves.png")
    plots = ["metric_vs_bits.png", "metric_vs_bits_per_iter.png", "metric_curves.png", "loss_curves.png"]
    if len({r["workers"] for r in runs}) > 1:
        plot_metric_vs_workers(runs, out / "metric_vs_workers.png")
        plots.insert(1, "metric_vs_workers.png")
    parts += [f"![{p[:-4]}]({p})\n" for p in plots]
    markdown = "\n".join(parts)
    (out / "results.md").write_text(markdown)
    write_csv(runs, out / "runs.csv")
    write_html(markdown, plots, out / "index.html")
    return runs


def write_html(markdown: str, plots: list[str], path: Path) -> None:
    """A static page with the tables (as preformatted Markdown) and the plots side by side."""
    body = "".join(f'<img src="{p}" style="max-width:48%">' for p in plots)
    path.write_text(
        f"<!doctype html><meta charset=utf-8><title>{path.parent.name}</title>"
        f"<body style='font-family:sans-serif'><pre>{html.escape(markdown)}</pre>{body}</body>"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="sweep directory holding run directories")
    parser.add_argument("--out", type=Path, required=True, help="where to write results.md, runs.csv and plots")
    parser.add_argument("--command", default=None, help="the command that produced the runs, recorded in results.md")
    args = parser.parse_args()
    runs = write_report(args.root, args.out, args.command)
    print(markdown_table(runs))


if __name__ == "__main__":
    main()
