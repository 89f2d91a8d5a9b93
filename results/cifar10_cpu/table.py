"""Markdown table of the cifar10_cpu runs: `python results/cifar10_cpu/table.py`.

A finished run is read from its summary.json; a run still going from the last line of its
metrics.jsonl (marked "running"), so the table can be printed at any time.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = {"adamw_n4": "G-AdamW, 4 workers x 32", "dlion_mavo_n8": "D-Lion MaVo, 8 workers x 16"}


def main() -> None:
    print("| run | status | epochs | test top-1 by epoch | final test top-1 | bits/param/iter | wall time |")
    print("|---|---|---:|---|---:|---:|---:|")
    for name, label in RUNS.items():
        metrics_path = HERE / name / "metrics.jsonl"
        if not metrics_path.exists():
            continue
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()]
        by_epoch = ", ".join(f"{m['eval_accuracy']:.3f}" for m in metrics if "eval_accuracy" in m)
        summary_path = HERE / name / "summary.json"
        if summary_path.exists():
            s = json.loads(summary_path.read_text())
            row = ("finished", f"{s['epochs']:.2f}", by_epoch, f"**{s['eval_accuracy']:.4f}**",
                   f"{s['bits_per_param_per_iter']:.4g}", f"{s['wall_time'] / 60:.0f} min")
        else:
            last = metrics[-1]
            bits = last["cum_bits_per_param"] / last["step"]
            row = ("running", f"{last['epoch']:.2f}", by_epoch, "-", f"{bits:.4g}", f"{last['wall_time'] / 60:.0f} min")
        print(f"| {label} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
