"""Time to target and statistics over seeds, on hand-written run folders (no training): `first_reaching` on a
hand-made curve, the time-to-target table and CSV columns with a seed that never reaches, mean ± std with n
in the tables and the error bars, and mean curves with a ±1 std band."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import distlion.report as report
from distlion.tasks import TASK_CONFIGS, task_metrics

# val_accuracy every 4 steps, per seed; with a target of 0.8, seed 0 reaches it at step 12, seed 1 at step 8
# (above it), seed 2 never.
ACCURACIES = {0: [0.2, 0.6, 0.8, 0.9], 1: [0.3, 0.85, 0.9, 0.95], 2: [0.1, 0.2, 0.3, 0.4]}
TEST_ACCURACY = {0: 0.80, 1: 0.84, 2: 0.90}
TARGET = {"metric": "val_accuracy", "value": 0.8, "source": "by hand"}


def bits_per_step(seed: int) -> float:
    return 60.0 + seed  # bits differ across seeds, as the sparse methods' do


def wall_time(seed: int, step: int) -> float:
    return step * (1 + seed / 10)


def write_seed(root: Path, seed: int, accuracies: list[float], method: str = "lion", target: dict | None = None,
               config: bool = True) -> None:
    """A finished digits run: summary.json, metrics.jsonl (train lines every step, an evaluation every 4th) and
    config.yaml recording `target` (none when `config` is false)."""
    steps = 4 * len(accuracies)
    metrics = task_metrics("digits")
    summary = {
        "method": method, "lr": 1e-3, "workers": 2, "per_worker_batch": 16, "global_batch": 32, "task": "digits",
        "seed": seed, "steps": steps, "epochs": 2.0, "num_params": 1000, "test_accuracy": TEST_ACCURACY[seed],
        "test_loss": 0.5, "val_accuracy": accuracies[-1], "val_loss": 0.5, "metric": "test_accuracy",
        "objective": "val_accuracy", "metrics": [dataclasses.asdict(m) for m in metrics],
        "bits_up_per_param_per_iter": bits_per_step(seed) / 2, "bits_down_per_param_per_iter": bits_per_step(seed) / 2,
        "bits_per_param_per_iter": bits_per_step(seed), "cum_bits_per_param": bits_per_step(seed) * steps,
        "total_bits": 1e6, "wall_time": wall_time(seed, steps), "config_hash": "0", "git_sha": "0",
    }
    run_dir = root / f"{method}-{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    curve = [{"step": s, "epoch": s / steps * 2, "train_loss": 2.0 / s + seed / 10,
              "cum_bits_per_param": bits_per_step(seed) * s, "wall_time": wall_time(seed, s),
              **({"val_accuracy": accuracies[s // 4 - 1], "val_loss": 1.0} if s % 4 == 0 else {})}
             for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in curve))
    if config:
        task = {"name": "digits", "val_examples": None, "target": target or {"metric": "val_accuracy", "value": None}}
        OmegaConf.save(OmegaConf.create({"task": task}), run_dir / "config.yaml")


def write_seeds(root: Path, target: dict | None = TARGET) -> list[report.Run]:
    for seed, accuracies in ACCURACIES.items():
        write_seed(root, seed, accuracies, target=target)
    return report.load_runs(root)


def by_hand(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1), written out."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def row(markdown: str, start: str) -> list[str]:
    return next(line for line in markdown.splitlines() if line.startswith(start)).strip("| ").split(" | ")


CURVE = [{"step": 1, "train_loss": 2.0}, {"step": 2, "epoch": 0.5, "wall_time": 3.0, "cum_bits_per_param": 4.0,
                                          "val_accuracy": 0.5, "val_loss": 1.5},
         {"step": 3, "train_loss": 1.0}, {"step": 4, "epoch": 1.0, "wall_time": 6.0, "cum_bits_per_param": 8.0,
                                          "val_accuracy": 0.7, "val_loss": 0.9}]


@pytest.mark.parametrize(("metric", "value", "higher", "step"), [
    ("val_accuracy", 0.4, True, 2),     # the first evaluation already beyond it
    ("val_accuracy", 0.5, True, 2),     # an exact hit reaches it
    ("val_accuracy", 0.6, True, 4),     # reached at the last point
    ("val_accuracy", 0.71, True, None),  # never
    ("val_loss", 1.5, False, 2),        # lower is better: an exact hit
    ("val_loss", 1.0, False, 4),
    ("val_loss", 0.5, False, None),
])
def test_first_reaching_reads_the_first_evaluation_at_or_beyond_the_target(metric, value, higher, step):
    reached = report.first_reaching(CURVE, metric, value, higher)
    if step is None:
        assert reached is None
    else:
        point = next(p for p in CURVE if p["step"] == step)
        assert reached == {"step": step, "epoch": point["epoch"], "wall_time": point["wall_time"],
                           "cum_bits_per_param": point["cum_bits_per_param"], metric: point[metric]}


def test_a_nan_never_reaches_a_target():
    assert report.first_reaching([{"step": 1, "val_loss": math.nan}], "val_loss", 10.0, False) is None


def test_time_to_target_over_three_seeds_one_never_reaching(tmp_path):
    write_seeds(tmp_path / "runs")
    report.write_report(tmp_path / "runs", tmp_path / "out")
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "Time to target, on the validation split. Target: digits: validation accuracy (%) ≥ 80.00 (by hand)." \
        in markdown
    assert "Evaluations every 25% of a run" in markdown and "all" in markdown
    # Mean ± std over the two seeds that reached it; the third counted, not averaged in.
    step, wall, bits = by_hand([12, 8]), by_hand([wall_time(0, 12), wall_time(1, 8)]), \
        by_hand([bits_per_step(0) * 12, bits_per_step(1) * 8])
    target_rows = markdown.split("Time to target")[1]
    assert row(target_rows, "| G-Lion |") == [
        "G-Lion", "2", "16", "3", "2/3 (1/3 not reached)", f"{step[0]:.0f} ± {step[1]:.0f}",
        f"{wall[0]:.1f} ± {wall[1]:.1f}", f"{bits[0]:,.1f} ± {bits[1]:,.1f}"]
    runs = {r["seed"]: r for r in csv.DictReader((tmp_path / "out" / "runs.csv").open())}
    assert [runs[s]["steps_to_target"] for s in ("0", "1", "2")] == ["12", "8", ""]
    assert float(runs["1"]["wall_time_to_target"]) == wall_time(1, 8)
    assert float(runs["1"]["bits_to_target"]) == bits_per_step(1) * 8
    assert runs["2"]["bits_to_target"] == "" and runs["2"]["target_value"] == "0.8"


def test_no_seed_reaching_is_not_reached_and_one_seed_is_its_value(tmp_path):
    write_seed(tmp_path / "runs", 2, ACCURACIES[2], method="lion", target=TARGET)
    write_seed(tmp_path / "runs", 0, ACCURACIES[0], method="adamw", target=TARGET)
    runs = report.load_runs(tmp_path / "runs")
    targets = report.task_targets(runs)
    report.reach_targets(runs, targets)
    table = str(report.time_to_target_table(runs, targets))
    assert row(table, "| G-Lion |")[3:] == ["1", "0/1 (1/1 not reached)", "not reached", "not reached",
                                            "not reached"]
    assert row(table, "| G-AdamW |")[3:] == ["1", "1/1", "12", "12.0", "720.0"]


def test_the_target_comes_from_the_argument_then_the_runs_config_then_the_tasks_config(tmp_path):
    runs = write_seeds(tmp_path / "recorded")
    assert report.task_targets(runs) == {"digits": report.Target("val_accuracy", 0.8, "by hand")}
    override = {"value": 0.3, "source": "a spec"}  # metric: the task's objective
    assert report.task_targets(runs, override) == {"digits": report.Target("val_accuracy", 0.3, "a spec")}
    write_seed(tmp_path / "unrecorded", 0, ACCURACIES[0], config=False)
    configured = OmegaConf.to_container(OmegaConf.load(TASK_CONFIGS / "digits.yaml").target)
    assert report.task_targets(report.load_runs(tmp_path / "unrecorded")) == {"digits": report.Target.of(configured)}


def test_a_target_not_set_is_said_and_a_bad_one_is_one_clear_error(tmp_path):
    runs = write_seeds(tmp_path / "runs", target={"metric": "val_accuracy", "value": None, "source": "pending"})
    report.write_report(tmp_path / "runs", tmp_path / "out", target={"metric": "val_accuracy", "value": None})
    assert "Target: digits: validation accuracy (%) ≥ none set yet." in (tmp_path / "out" / "results.md").read_text()
    assert {r["steps_to_target"] for r in csv.DictReader((tmp_path / "out" / "runs.csv").open())} == {""}
    with pytest.raises(ValueError, match="not a validation metric it logs; choose one of"):
        report.task_targets(runs, {"metric": "test_accuracy", "value": 0.5})
    with pytest.raises(ValueError, match="finite number"):
        report.task_targets(runs, {"value": "high"})
    with pytest.raises(ValueError, match="unknown keys"):
        report.task_targets(runs, {"valeu": 0.5})
    write_seed(tmp_path / "mixed", 0, ACCURACIES[0], target=TARGET)
    write_seed(tmp_path / "mixed", 1, ACCURACIES[1], target={**TARGET, "value": 0.9})
    with pytest.raises(ValueError, match="recorded different targets"):
        report.task_targets(report.load_runs(tmp_path / "mixed"))


def test_every_task_config_names_a_validation_target_and_how_it_was_obtained():
    for path in TASK_CONFIGS.glob("*.yaml"):
        target = report.Target.of(OmegaConf.to_container(OmegaConf.load(path).target), where=path.name)
        metric = next(m for m in task_metrics(path.stem) if m.key == target.metric)
        assert metric.split == "validation" and target.source


def test_mean_std_and_n_from_per_seed_summaries(tmp_path):
    runs = write_seeds(tmp_path)
    mean, std = by_hand([100 * TEST_ACCURACY[s] for s in (0, 1, 2)])
    cells = row(str(report.markdown_table(runs)), "| G-Lion |")
    assert cells[3] == f"{mean:.2f} ± {std:.2f}" and cells[7] == "3"  # test accuracy, n
    bits_mean = sum(bits_per_step(s) for s in (0, 1, 2)) / 3
    assert cells[10] == f"{bits_mean:.3f}"  # total bits/param/iter: the mean over seeds, not the first seed's
    assert row(str(report.pivot_table(runs)), "| G-Lion |")[1] == f"{mean:.2f} ± {std:.2f} (n=3)"
    ax = report.plot_metric_vs_bits_per_iter(runs, tmp_path / "bits.png")
    (bar,) = ax.containers
    assert list(bar.lines[0].get_xdata()) == [bits_mean] and list(bar.lines[0].get_ydata()) == pytest.approx([mean])
    (segment,) = bar.lines[2][0].get_segments()
    assert [y for _, y in segment] == pytest.approx([mean - std, mean + std])
    assert ax.get_title() == "mean over seeds (n = 3 per group), error bars: ±1 sample std"


def test_a_curve_of_three_seeds_is_one_mean_line_and_one_band(tmp_path):
    runs = write_seeds(tmp_path)
    ax = report.plot_metric_curves(runs, tmp_path / "curves.png")
    (line,), (band,) = ax.get_lines(), ax.collections
    assert list(line.get_xdata()) == [4, 8, 12, 16]
    spreads = [by_hand([100 * ACCURACIES[s][i] for s in (0, 1, 2)]) for i in range(4)]
    assert list(line.get_ydata()) == pytest.approx([m for m, _ in spreads])
    corners = {(round(x, 6), round(y, 6)) for x, y in band.get_paths()[0].vertices}
    for x, (m, s) in zip([4, 8, 12, 16], spreads):
        assert {(x, round(m - s, 6)), (x, round(m + s, 6))} <= corners
    assert "n = 3" in ax.get_title()
    # Against bits, the seeds are aligned on their steps and drawn at the mean bits.
    (line,) = report.plot_metric_vs_bits(runs, tmp_path / "bits.png").get_lines()
    assert list(line.get_xdata()) == pytest.approx([sum(bits_per_step(s) for s in (0, 1, 2)) / 3 * x
                                                    for x in (4, 8, 12, 16)])
    ax = report.plot_loss_curves(runs, tmp_path / "loss.png")
    assert len(ax.get_lines()) == 1 and len(ax.collections) == 1 and len(ax.get_lines()[0].get_xdata()) == 16


def test_a_single_seed_keeps_its_own_line_without_a_band(tmp_path):
    write_seed(tmp_path, 0, ACCURACIES[0])
    ax = report.plot_metric_curves(report.load_runs(tmp_path), tmp_path / "curves.png")
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[100 * a for a in ACCURACIES[0]]]
    assert not ax.collections and ax.get_title() == "one seed per group"


def test_a_spec_s_report_target_reaches_the_report(tmp_path):
    """`report: {target: ...}` in a spec overrides the runs' recorded target (here 0.8 -> 0.3)."""
    import subprocess
    import sys

    write_seeds(tmp_path / "runs" / "t")
    spec = tmp_path / "t.yaml"
    spec.write_text("name: t\nsweeps: []\nreport:\n  target: {metric: val_accuracy, value: 0.3, source: the spec}\n")
    done = subprocess.run([sys.executable, "-m", "distlion.experiment", str(spec), "--report-only", "--out",
                           str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    results = (tmp_path / "results" / "t" / "results.md").read_text()
    assert "≥ 30.00 (the spec)" in results and "by hand" not in results


def test_a_target_is_derived_from_tuned_g_adamw_at_75_percent_of_its_steps_and_written_into_the_task(tmp_path):
    # 16 steps, evaluations at 4, 8, 12, 16: 75% is step 12, the third evaluation of each G-AdamW seed.
    for seed, accuracies in ACCURACIES.items():
        write_seed(tmp_path / "runs", seed, accuracies, method="adamw")
    write_seed(tmp_path / "runs", 0, [0.99] * 4, method="lion")  # another method: not read
    runs = report.load_runs(tmp_path / "runs")
    task, target = report.derive_target(runs, "G-AdamW", 0.75, {"workers": 2}, spec="s")
    expected = (0.8 + 0.9 + 0.3) / 3
    assert task == "digits" and target.metric == "val_accuracy" and target.value == pytest.approx(expected)
    assert "seeds [0, 1, 2]" in target.source and "75% of its 16 steps (steps [12]; workers=2)" in target.source
    assert report.derive_target(runs, "G-AdamW", 0.5)[1].value == pytest.approx((0.6 + 0.85 + 0.2) / 3)
    with pytest.raises(ValueError, match="no finished G-AdamW run with {'workers': 8}"):
        report.derive_target(runs, "G-AdamW", 0.75, {"workers": 8})

    config = tmp_path / "digits.yaml"
    original = (TASK_CONFIGS / "digits.yaml").read_text()
    config.write_text(original)
    report.write_task_target(config, target)
    written = OmegaConf.load(config).target
    assert written.value == pytest.approx(expected, rel=1e-6) and written.source == target.source
    assert written.metric == "val_accuracy"
    kept = [line for line in original.splitlines() if not line.startswith(("  value:", "  source:"))]
    assert [line for line in config.read_text().splitlines() if not line.startswith(("  value:", "  source:"))] == kept
