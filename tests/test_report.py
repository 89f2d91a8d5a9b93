"""The report on hand-written run folders (no training): the tasks' declared metrics reach the tables and
CSV, old summaries still report, every swept setting gets its own legend entry and look, and method
labels come from the method registry."""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
from pathlib import Path

import pytest

import distlion.report as report
from distlion.tasks import task_metrics


def write_run(root: Path, method: str = "lion", workers: int = 2, per_worker_batch: int = 16, seed: int = 0,
              lr: float = 1e-3, task: str = "digits", new_style: bool = True, **values: float) -> dict:
    """A finished run folder: summary.json as train.py writes it (`new_style`: with the config name and the
    declared metrics; else the class name, no metrics and `eval_*` keys, as older summaries), and a
    metrics.jsonl curve."""
    metrics = task_metrics(task, legacy=not new_style)
    values = {m.key: 0.5 for m in metrics} | values
    steps = 64 // workers  # a fixed epoch count: the steps follow from the workers
    summary = {
        "method": method,
        **{f"method.{k}": v for k, v in {"aggregation": "avg", "betas": [0.9, 0.99]}.items() if method == "dlion"},
        "lr": lr, "workers": workers, "per_worker_batch": per_worker_batch, "global_batch": workers * per_worker_batch,
        "task": task, "seed": seed, "steps": steps, "epochs": 2.0, "num_params": 1000, **values,
        "metric": metrics[0].key, "bits_up_per_param_per_iter": 32.0, "bits_down_per_param_per_iter": 32.0,
        "bits_per_param_per_iter": 64.0, "cum_bits_per_param": 64.0 * steps, "total_bits": 64_000 * steps,
        "wall_time": 60.0, "config_hash": "0", "git_sha": "0",
    }
    if new_style:
        summary["metrics"] = [dataclasses.asdict(m) for m in metrics]
    else:
        summary["task"] = {"shakespeare": "LanguageModelTask", "gutenberg": "LanguageModelTask",
                           "digits": "DigitsTask"}[task]
    run_dir = root / f"{method}-{workers}-{per_worker_batch}-{lr}-{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    curve = [{"step": s, "epoch": s / steps * 2, "train_loss": 2.0 / s, "cum_bits_per_param": 64.0 * s,
              **({k: v for k, v in values.items()} if s % 4 == 0 else {})} for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in curve))
    return summary


def rows(path: Path) -> list[dict]:
    return list(csv.DictReader(path.open()))


def table_row(markdown: str, start: str) -> str:
    return next(line for line in markdown.splitlines() if line.startswith(start))


@pytest.mark.parametrize(("task", "extra", "display", "shown"), [
    ("imagenet", "test_top5", "test top-5 (%)", "81.25"),
    ("imagenet", "val_top5", "validation top-5 (%)", "81.25"),
    ("shakespeare", "test_perplexity", "test perplexity", "0.8125"),
])
def test_a_tasks_extra_metric_reaches_the_csv_and_the_table(tmp_path, task, extra, display, shown):
    assert extra not in Path(report.__file__).read_text()  # the report knows it only from the task's declaration
    write_run(tmp_path / "runs", task=task, **{extra: 0.8125})
    report.write_report(tmp_path / "runs", tmp_path / "out")
    (row,) = rows(tmp_path / "out" / "runs.csv")
    assert float(row[extra]) == 0.8125
    markdown = (tmp_path / "out" / "results.md").read_text()
    header = table_row(markdown, "| method | workers |").split(" | ")
    cells = table_row(markdown, "| G-Lion | 2 | 16 |").split(" | ")
    assert cells[header.index(display)] == shown
    assert f"on the {task_metrics(task)[0].split} split" in markdown


def test_an_old_summary_reports_with_its_classs_headline_and_a_readable_task(tmp_path):
    write_run(tmp_path / "runs", method="dlion", task="shakespeare", new_style=False, eval_loss=4.25,
              eval_perplexity=70.1, unigram_entropy=5.75)
    report.write_report(tmp_path / "runs", tmp_path / "out")
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "runs of task language model" in markdown and "LanguageModelTask" not in markdown
    header = table_row(markdown, "| method | workers |").split(" | ")
    assert header[3:5] == ["validation loss (nats/token)", "validation perplexity"]  # the headline first
    assert table_row(markdown, "| D-Lion (Avg) | 2 | 16 |").startswith("| D-Lion (Avg) | 2 | 16 | 4.2500 | 70.1000 |")
    assert "unigram entropy" not in header  # a reference: written under the table, not a score column
    assert "the unigram entropy of the tokenizer's training data, 5.750 nats/token" in markdown
    assert rows(tmp_path / "out" / "runs.csv")[0]["task"] == "language model"


def test_the_method_label_comes_from_the_registry(tmp_path):
    write_run(tmp_path / "runs", method="dlion")  # method.aggregation=avg
    report.write_report(tmp_path / "runs", tmp_path / "out")
    assert rows(tmp_path / "out" / "runs.csv")[0]["label"] == "D-Lion (Avg)"
    assert "| D-Lion (Avg) | 2 | 16 |" in (tmp_path / "out" / "results.md").read_text()


def test_a_workers_by_batch_sweep_shows_four_groups_each_in_its_own_style(tmp_path):
    for workers in (2, 4):
        for batch in (16, 32):
            for seed in (0, 1):
                write_run(tmp_path, workers=workers, per_worker_batch=batch, seed=seed,
                          test_accuracy=0.5 + workers / 100 + batch / 1000 + seed / 500)
    runs = report.load_runs(tmp_path)
    ax = report.plot_metric_curves(runs, tmp_path / "curves.png")
    handles, labels = ax.get_legend_handles_labels()
    assert labels == ["G-Lion, N=2, batch 16/worker", "G-Lion, N=2, batch 32/worker",
                      "G-Lion, N=4, batch 16/worker", "G-Lion, N=4, batch 32/worker"]  # steps follow from N
    styles = {(h.get_color(), h.get_linestyle(), h.get_marker()) for h in handles}
    assert len(styles) == 4

    ax = report.plot_metric_vs_workers(runs, tmp_path / "workers.png")
    handles, labels = ax.get_legend_handles_labels()
    assert labels == ["G-Lion, batch 16/worker", "G-Lion, batch 32/worker"]
    for handle in handles:
        xs = list(handle[0].get_xdata())
        assert xs == sorted(set(xs)) == [2, 4]

    # Mean ± std over the two seeds of each of the same four groups.
    table = str(report.markdown_table(runs))
    for workers in (2, 4):
        for batch in (16, 32):
            accs = [100 * (0.5 + workers / 100 + batch / 1000 + seed / 500) for seed in (0, 1)]
            row = table_row(table, f"| G-Lion | {workers} | {batch} |")
            assert f"| {statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f} |" in row
            assert "| 2 |" in row  # n


def test_a_swept_learning_rate_gets_a_column_and_a_legend_entry(tmp_path):
    for lr in (1e-3, 3e-3):
        write_run(tmp_path, lr=lr)
    runs = report.load_runs(tmp_path)
    header = table_row(str(report.markdown_table(runs)), "| method |")
    assert header.startswith("| method | workers | per-worker batch | lr |")
    labels = report.plot_metric_vs_bits(runs, tmp_path / "bits.png").get_legend_handles_labels()[1]
    assert labels == ["G-Lion, lr=0.001", "G-Lion, lr=0.003"]


def test_a_method_setting_others_do_not_have_is_a_dash_in_their_rows_and_absent_from_their_names(tmp_path):
    """LocalSGD's sync_every, swept beside G-Lion (which has none): "—" in G-Lion's cells, not "None"."""
    write_run(tmp_path)
    for every in (10, 50):
        write_run(tmp_path / str(every), method="localsgd", **{"method.sync_every": every})
    runs = report.load_runs(tmp_path)
    table = str(report.markdown_table(runs))
    assert table_row(table, "| G-Lion |").startswith("| G-Lion | 2 | 16 | — |")
    assert table_row(table, "| LocalSGD | 2 | 16 | 10 |")
    pivot = str(report.pivot_table(runs, "workers"))
    assert table_row(pivot, "| G-Lion").startswith("| G-Lion |")  # not "G-Lion, sync_every=None"
    assert table_row(pivot, "| LocalSGD, sync_every=50 |")


def test_runs_with_and_without_the_last_sync_are_two_groups(tmp_path):
    """train.final_sync changes what a LocalSGD run counts: swept, its two values are two rows, not six seeds."""
    write_run(tmp_path)
    for ended in (True, False):
        for seed in range(3):
            write_run(tmp_path / f"{ended}{seed}", method="localsgd", seed=seed, final_sync=ended)
    pivot = str(report.pivot_table(report.load_runs(tmp_path), "workers"))
    for ended in (True, False):
        assert table_row(pivot, f"| LocalSGD, final sync {ended} |")
    assert table_row(pivot, "| G-Lion |")


def test_tasks_with_other_metrics_cannot_share_a_table_and_with_the_same_ones_are_told_apart(tmp_path):
    write_run(tmp_path / "mixed", task="digits")
    write_run(tmp_path / "mixed", task="shakespeare", workers=4)
    with pytest.raises(ValueError, match="declare different metrics"):
        report.write_report(tmp_path / "mixed", tmp_path / "out")
    # Summaries from before and after the validation split measure different splits: not one table.
    write_run(tmp_path / "old_and_new", task="shakespeare", new_style=False)
    write_run(tmp_path / "old_and_new", task="shakespeare", seed=1)
    with pytest.raises(ValueError, match="declare different metrics"):
        report.write_report(tmp_path / "old_and_new", tmp_path / "out")
    # Two tasks with the same metrics: the same columns, two groups told apart by their task.
    write_run(tmp_path / "lm", task="gutenberg")
    write_run(tmp_path / "lm", task="shakespeare", seed=1)
    ax = report.plot_metric_curves(report.load_runs(tmp_path / "lm"), tmp_path / "curves.png")
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["G-Lion, task=gutenberg", "G-Lion, task=shakespeare",
                      "unigram entropy of the tokenizer's training data: 0.500"]  # the reference line


def test_tables_show_the_test_headline_and_curves_the_validation_metric(tmp_path):
    write_run(tmp_path, test_accuracy=0.9, val_accuracy=0.8)
    summary = json.loads(next(tmp_path.rglob("summary.json")).read_text())
    summary["splits"] = {"train": 1077, "validation": 270, "test": 450, "unit": "images", "seed": 0, "stratified": True}
    next(tmp_path.rglob("summary.json")).write_text(json.dumps(summary))
    runs = report.load_runs(tmp_path)
    table = str(report.markdown_table(runs))
    header = table_row(table, "| method |").split(" | ")
    assert header[3:7] == ["test accuracy (%)", "test loss (nats)", "validation accuracy (%)", "validation loss (nats)"]
    assert table_row(table, "| G-Lion | 2 | 16 |").startswith("| G-Lion | 2 | 16 | 90.00 | 0.5000 | 80.00 |")
    assert str(report.pivot_table(runs)).startswith("test accuracy (%), mean ± std over seeds")
    ax = report.plot_metric_curves(runs, tmp_path / "curves.png")
    assert ax.get_ylabel() == "validation accuracy (%)"
    assert set(ax.get_lines()[0].get_ydata()) == {80.0}
    intro = report._intro(runs)
    assert "test accuracy (%) and test loss (nats) on the test split" in intro
    assert "validation accuracy (%) and validation loss (nats) on the validation split" in intro
    assert "Splits (train / validation / test): 1,077 / 270 / 450 images, stratified, seed 0." in intro


def test_the_few_shot_table_gives_mean_std_over_seeds_lm_evals_stderr_and_chance(tmp_path):
    for seed, (acc, err) in enumerate([(0.30, 0.02), (0.40, 0.04)]):
        write_run(tmp_path, method="dlion", seed=seed, task="shakespeare", fewshot_acc_nextline=acc,
                  fewshot_acc_stderr_nextline=err, fewshot_acc_norm_nextline=0.5, fewshot_chance_nextline=0.25)
    write_run(tmp_path, method="lion", task="shakespeare", fewshot_acc_nextline=0.26,
              fewshot_acc_stderr_nextline=0.03, fewshot_chance_nextline=0.25)
    table = str(report.fewshot_table(report.load_runs(tmp_path)))
    assert "chance: nextline 25%" in table
    assert "| D-Lion (Avg) | 2 | 16 | 2 | 35.0 ± 7.1 [3.0] |" in table  # stdev of 30, 40 = 7.07
    assert "| G-Lion | 2 | 16 | 1 | 26.0 [3.0] |" in table
    write_run(tmp_path / "none", task="shakespeare")
    assert report.fewshot_table(report.load_runs(tmp_path / "none")) == ""


def test_the_fault_table_puts_honest_runs_at_k0_of_every_kind_and_averages_seeds(tmp_path):
    accuracy = {(0, None): [0.9, 0.8], (1, "flip"): [0.7, 0.5], (2, "flip"): [0.2, 0.4], (1, "scaled"): [0.85, 0.75]}
    for (k, kind), values in accuracy.items():
        for seed, value in enumerate(values):
            summary = write_run(tmp_path / f"{k}-{kind}", method="dlion", workers=8, seed=seed, test_accuracy=value)
            path = tmp_path / f"{k}-{kind}" / f"dlion-8-16-0.001-{seed}" / "summary.json"
            path.write_text(json.dumps(summary | {"faults_k": k, "faults_kind": kind}))
    write_run(tmp_path / "old", method="lion", workers=8, test_accuracy=0.6)  # before faults: honest, k = 0
    runs = report.load_runs(tmp_path)
    table = str(report.fault_table(runs))
    flip, scaled = table_row(table, "| D-Lion (Avg) | flip |"), table_row(table, "| D-Lion (Avg) | scaled |")
    assert flip.split(" | ")[2:] == ["85.00 ± 7.07 (n=2)", "60.00 ± 14.14 (n=2)", "30.00 ± 14.14 (n=2) |"]
    assert scaled.split(" | ")[2:] == ["85.00 ± 7.07 (n=2)", "80.00 ± 7.07 (n=2)", "— |"]
    assert table_row(table, "| G-Lion | flip |").split(" | ")[2:] == ["60.00 (n=1)", "—", "— |"]
    assert report.fault_table([r for r in runs if not r["faults_k"]]) == ""  # no faulty workers: no table
    report.write_report(tmp_path, tmp_path / "out")
    assert (tmp_path / "out" / "metric_vs_faults.png").exists()


@pytest.mark.parametrize("run, steps", [
    ({"method.sync_every": 10, "final_sync": True}, [5, 15]),
    ({"method.sync_every": 10, "final_sync": False}, [5, 15, 17]),
    ({}, [5, 10, 15, 17]),
])
def test_replica_diagnostics_read_only_the_evaluations_between_syncs(run, steps):
    """At a sync step (every H-th, and the last with `final_sync`) the workers hold the model that counts, so the
    drift and the averaging gain there are 0 by construction and would pull the means towards 0."""
    curve = [{"step": s, "worker_drift": 1.0 if s in steps else 0.0} for s in (5, 10, 15, 17)]
    run = {**run, "curve": curve}
    assert [p["step"] for p in report._between_syncs(run)] == steps
    assert report._mean_drift(run) == 1.0


def test_paired_differences_with_their_t_interval_and_where_d_lion_loses(tmp_path):
    """Each method minus G-AdamW at the same seed: mean and 95% t-interval (t(0.975, 2) = 4.3027), by hand."""
    adamw = [0.80, 0.82, 0.90]
    dlion = [0.70, 0.74, 0.78]  # differences -10, -8, -12 points: mean -10, sd 2
    lion = [0.90, 0.70, 0.92]  # differences +10, -12, +2: the interval covers 0
    for seed in range(3):
        write_run(tmp_path, "adamw", seed=seed, test_accuracy=adamw[seed])
        write_run(tmp_path, "dlion", seed=seed, test_accuracy=dlion[seed])
        write_run(tmp_path, "lion", seed=seed, test_accuracy=lion[seed])
    write_run(tmp_path, "dlion", seed=7, test_accuracy=0.1)  # no G-AdamW run at seed 7: not paired
    report.write_report(tmp_path, tmp_path / "out")
    md = (tmp_path / "out" / "results.md").read_text()
    md = md[md.index("each method minus G-AdamW at the same seed"):]  # the paired table and its sentences
    half = 4.302653 * 2 / 3 ** 0.5
    interval = f"[{-10 - half:+.2f}, {-10 + half:+.2f}]"
    assert table_row(md, "| D-Lion (Avg) |") == f"| D-Lion (Avg) | -10.00 {interval} (n=3) |"
    lion_row = table_row(md, "| G-Lion |")
    assert lion_row.startswith("| G-Lion | +0.00 [") and lion_row.endswith("(n=3) not resolved |")
    assert f"- D-Lion (Avg) loses to G-AdamW at every setting: -10.00 {interval}" in md
    assert report.paired_table(report.load_runs(tmp_path), "TernGrad") == ("", [])  # the reference did not run


def test_provenance_flags_dirty_runs_and_commits_whose_method_code_differs(tmp_path, monkeypatch):
    import subprocess

    repo = tmp_path / "repo"
    (repo / "distlion" / "methods").mkdir(parents=True)

    def commit(path: str, text: str) -> str:
        (repo / path).write_text(text)
        for args in (["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", path]):
            subprocess.run(["git", *args], cwd=repo, check=True)
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True,
                              text=True).stdout.strip()

    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    first = commit("distlion/methods/rule.py", "x = 1\n")
    docs = commit("README.md", "words\n")
    code = commit("distlion/methods/rule.py", "x = 2\n")
    monkeypatch.setattr(report, "REPO", repo)
    runs = [{"git_sha": first, "git_dirty": False}, {"git_sha": docs, "git_dirty": False}]
    text, problems = report.provenance(runs)
    assert problems == [] and "the method and task code is the same in all" in text
    text, problems = report.provenance([*runs, {"git_sha": code, "git_dirty": True}])
    assert problems[0] == "1 of 3 runs record git_dirty: true (their code may differ from their commit)"
    assert "method or task code differs (distlion/methods/rule.py)" in problems[1]
    assert "**Not a clean table:" in text
    _, problems = report.provenance([*runs, {"git_sha": "f" * 40, "git_dirty": False}])
    assert "cannot be checked here" in problems[0]

    root = tmp_path / "runs"
    write_run(root, "adamw", git_dirty=True)
    with pytest.raises(report.ProvenanceError, match="--strict: 1 of 1 runs record git_dirty"):
        report.write_report(root, tmp_path / "out", strict=True)
    assert not (tmp_path / "out").exists()  # refused before anything is written
    report.write_report(root, tmp_path / "out")
    assert "**Not a clean table: 1 of 1 runs record git_dirty: true" in (tmp_path / "out" / "results.md").read_text()
