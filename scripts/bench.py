"""`make bench`: every benchmarks/bench_*.py, side-by-side ratios, written to results/bench.md."""

from __future__ import annotations

import importlib.util
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    only = set(sys.argv[1:])
    rows = []
    for path in sorted((REPO / "benchmarks").glob("bench_*.py")):
        if only and path.stem.removeprefix("bench_") not in only:
            continue
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        start = time.time()
        print(f"running {path.name} ...", flush=True)
        for row in module.run():
            rows.append({**row, "source": path.name})
            print(
                f"  {row['name']}: {row['value']:.3g} {row['unit']} (target {row['target']}) {row['detail']}",
                flush=True,
            )
        print(f"  ({time.time() - start:.0f} s)", flush=True)
    lines = [
        "# Benchmarks",
        "",
        "Produced by `make bench` (`python scripts/bench.py`). Each figure is a ratio of two things measured side by",
        "side in one process (interleaved repetitions, medians), so it survives a slower or busier machine better than",
        f"a time would. Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}.",
        "",
        "| benchmark | value | unit | target | detail | source |",
        "|---|---:|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | {row['value']:.3g} | {row['unit']} | {row['target'] or ''} | {row['detail']} "
            f"| {row['source']} |"
        )
    if only:
        return  # a partial run never replaces the full table
    out = REPO / "results" / "bench.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
