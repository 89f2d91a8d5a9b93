"""Validation loss of the lm_cpu runs against steps and against cumulative bits per parameter.

`python results/lm_cpu/plot.py` reads results/lm_cpu/*/metrics.jsonl and summary.json and writes
curves.png and curves.csv; the dashed line is the unigram entropy of the tokenizer's training data.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
LABELS = {"adamw_n4": "G-AdamW", "lion_n4": "G-Lion", "dlion_n4": "D-Lion MaVo", "dlion_avg_n4": "D-Lion Avg"}


def main() -> None:
    fig, (by_step, by_bits) = plt.subplots(1, 2, figsize=(11, 4))
    rows = ["run,step,cum_bits_per_param,eval_loss,eval_perplexity"]
    entropy = None
    for name, label in LABELS.items():
        path = HERE / name / "metrics.jsonl"
        if not path.exists():
            continue
        evals = [m for m in map(json.loads, path.read_text().splitlines()) if "eval_loss" in m]
        entropy = evals[-1]["unigram_entropy"]
        loss = [m["eval_loss"] for m in evals]
        by_step.plot([m["step"] for m in evals], loss, marker=".", label=label)
        by_bits.plot([m["cum_bits_per_param"] for m in evals], loss, marker=".", label=label)
        rows += [f"{name},{m['step']},{m['cum_bits_per_param']:.6g},{m['eval_loss']:.4f},"
                 f"{m['eval_perplexity']:.2f}" for m in evals]
    for ax, xlabel in ((by_step, "step"), (by_bits, "cumulative bits per parameter (up + down)")):
        if entropy is not None:
            ax.axhline(entropy, color="gray", linestyle="--", label=f"unigram entropy ({entropy:.2f})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
    by_bits.set_xscale("log")
    by_step.legend()
    fig.suptitle("llama_cpu on Tiny Shakespeare, 4 workers x 4 blocks of 256 tokens")
    fig.tight_layout()
    fig.savefig(HERE / "curves.png", dpi=120)
    (HERE / "curves.csv").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
