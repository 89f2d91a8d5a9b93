"""The alpha-beta step-time model against hand-computed times."""

from __future__ import annotations

import statistics

import pytest

from distlion.costmodel import Calibration, Link, Transfer, comm_seconds, transfers
from distlion.tasks.base import Metric


def test_each_collective_moves_its_algorithms_bytes_in_its_rounds():
    n = 4
    assert (Transfer("all_reduce", 400).bytes_per_rank(n), Transfer("all_reduce", 400).rounds(n)) == (600, 6)
    assert (Transfer("all_to_all", 400).bytes_per_rank(n), Transfer("all_to_all", 400).rounds(n)) == (300, 3)
    assert (Transfer("all_gather", 100).bytes_per_rank(n), Transfer("all_gather", 100).rounds(n)) == (300, 3)
    assert Transfer("all_reduce", 400, calls=5).rounds(n) == 30  # DDP: one ring per bucket
    with pytest.raises(ValueError, match="not one of"):
        Transfer("broadcast", 1).bytes_per_rank(n)


def test_an_exchange_is_the_collectives_of_its_kind():
    # D-Lion Avg at N=4 over n = 800 parameters: 1 bit up, 3 bits down per parameter.
    assert transfers("sharded", 800, 2400, 4) == [Transfer("all_to_all", 100), Transfer("all_gather", 75)]
    assert transfers("mean", 32 * 800, 32 * 800, 4) == [Transfer("all_reduce", 3200)]
    assert transfers("in_backward", 16 * 800, 16 * 800, 4, buckets=3) == [Transfer("all_reduce", 1600, calls=3)]
    assert transfers("allgather", 640, 0, 4) == [Transfer("all_gather", 80)]


def test_link_time_is_rounds_times_alpha_plus_bytes_over_bandwidth():
    link = Link(bandwidth=8e6, alpha=1e-3)  # 1 MB/s
    assert link.seconds(rounds=2, nbytes=1000) == pytest.approx(2e-3 + 1e-3)
    # Ring all-reduce of 4 MB over 4 ranks: 6 MB per rank at 1 MB/s, 6 rounds.
    assert comm_seconds([Transfer("all_reduce", 4e6)], 4, link) == pytest.approx(6.0 + 6e-3)


def test_a_calibrated_step_moves_to_another_link_by_what_the_link_changes():
    reference, slow = Link(bandwidth=None, alpha=1e-4), Link(bandwidth=8e6, alpha=1e-3)
    plain = Calibration("adamw", 4, compute=1.0, codec=0.1, comm=0.2, hidden=0.0,
                        transfers=(Transfer("all_reduce", 4e6),))
    step = plain.step(slow, reference)
    extra = 6.0 + 6 * (1e-3 - 1e-4)
    assert step["comm"] == pytest.approx(0.2 + extra) and step["step"] == pytest.approx(1.1 + 0.2 + extra)
    assert plain.step(reference, reference)["step"] == pytest.approx(1.3)  # the reference itself
    # DDP hid 0.5 of its 0.6 s on the reference; a slower link hides the same share of more communication,
    # until backward (2/3 of compute) is covered.
    ddp = Calibration("ddp", 4, compute=1.0, codec=0.1, comm=0.6, hidden=0.5,
                      transfers=(Transfer("all_reduce", 4e6, calls=4),), overlaps=True)
    assert ddp.step(reference, reference)["hidden"] == pytest.approx(0.5)  # the measurement itself
    assert ddp.step(slow, reference)["hidden"] == pytest.approx(2 / 3)
    fast = Link(bandwidth=None, alpha=0.0)
    shorter = ddp.step(fast, reference)
    assert shorter["hidden"] == pytest.approx(5 / 6 * shorter["comm"]) and shorter["comm"] < 0.6


def test_scale_predictions_follow_the_model_by_hand():
    from distlion.wallclock import Workload, powersgd_entries, scale_step

    # PowerSGD's rule: a 100 x 100 matrix at rank 4 sends 800 entries (< half of 10,000); a 4 x 4 one and a vector
    # go whole.
    assert powersgd_entries([(100, 100), (4, 4), (7,)], rank=4) == 800 + 16 + 7
    load = Workload("toy", params=8e6, powersgd_entries=1e5, compute_s=1.0, source="by hand")
    # D-Lion at N=4 on 8 Gbit/s, alpha 10 us: all-to-all of 1 MB (0.75 MB per rank, 3 rounds) and all-gather of
    # 0.25 MB per rank (0.75 MB, 3 rounds): 1.5 MB = 12 Mbit -> 1.5 ms + 6 x 10 us; codec 25 n bytes at 1.5 TB/s.
    assert scale_step("dlion", load, 4, 8) == pytest.approx(1.0 + 25 * 8e6 / 1.5e12 + 1.5e-3 + 60e-6)
    # bf16 DDP: 16 MB in 2 buckets of the ring (2 x 3/4 of it per rank = 24 MB = 192 Mbit -> 24 ms), 12 rounds,
    # hidden behind 2/3 s of backward but for the last bucket's half.
    comm = 24e-3 + 12 * 10e-6
    assert scale_step("ddp_bf16", load, 4, 8) == pytest.approx(1.0 + 6 * 8e6 / 1.5e12 + comm / 2)
    # D-Lion's DDP-hook form: the same 1.5 MB per rank in 2 buckets (12 rounds), hidden but for the last bucket's.
    comm = 1.5e-3 + 12 * 10e-6
    assert scale_step("dlion_ddp", load, 4, 8) == pytest.approx(1.0 + 25 * 8e6 / 1.5e12 + comm / 2)


def write_timed_run(root, method: str, link: str, step_s: float, steps: int, accuracies: list[float]) -> None:
    """A finished run on a link: a metrics line every step with its phase times, an evaluation every 4."""
    import dataclasses
    import json

    from distlion.tasks import task_metrics

    run_dir = root / f"{method}-{link}"
    run_dir.mkdir(parents=True)
    summary = {"method": method, "exchange": "sharded" if method == "dlion" else "in_backward", "lr": 1e-3,
               "workers": 4, "per_worker_batch": 8, "task": "digits", "seed": 0, "steps": steps, "num_params": 800,
               "link": link, "link_measured": None, "val_accuracy": accuracies[-1], "metric": "test_accuracy",
               "objective": "val_accuracy", "metrics": [dataclasses.asdict(m) for m in task_metrics("digits")],
               "wall_time": steps * step_s, "config_hash": link}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    lines = []
    for s in range(1, steps + 1):
        line = {"step": s, "bits_up_per_param": 1.0, "bits_down_per_param": 1.0, "time_compute": step_s / 2,
                "time_encode": 0.0, "time_comm": step_s / 2, "time_comm_hidden": 0.0, "time_apply": 0.0,
                "time_step": step_s}
        if s % 4 == 0:
            line["val_accuracy"] = accuracies[s // 4 - 1]
        lines.append(json.dumps(line))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_time_to_target_is_the_steps_of_the_longest_run_times_each_links_step_time(tmp_path):
    from distlion.report import curve_metric, load_runs
    from distlion.wallclock import time_to_target, write

    write_timed_run(tmp_path, "dlion", "none", 0.5, 16, [0.2, 0.5, 0.8, 0.9])  # reaches 0.8 at step 12
    write_timed_run(tmp_path, "dlion", "100mbit", 2.0, 8, [0.2, 0.5])
    write_timed_run(tmp_path, "ddp", "none", 1.0, 16, [0.3, 0.6, 0.7, 0.85])  # reaches 0.8 at step 16
    write_timed_run(tmp_path, "ddp", "100mbit", 8.0, 8, [0.3, 0.6])
    runs = load_runs(tmp_path)
    table = {t.label: t for t in time_to_target(runs, curve_metric(runs), 0.8)}
    assert table["D-Lion (MaVo)"].steps == 12 and table["D-Lion (MaVo)"].seconds == {"100mbit": 24.0, "none": 6.0}
    assert table["DDP AdamW (fp32)"].steps == 16
    assert table["DDP AdamW (fp32)"].seconds == {"100mbit": 128.0, "none": 16.0}
    markdown = write(tmp_path, tmp_path / "out", metric_value=0.8)
    assert "| D-Lion (MaVo) | 12 | 24 | 6 |" in markdown
    assert (tmp_path / "out" / "accuracy_vs_time.png").read_bytes()[:4] == b"\x89PNG"


def test_a_warm_up_before_start_iter_is_left_out_of_the_step_time_and_the_calibration(tmp_path):
    """PowerSGD all-reduces fp32 for its first `start_iter` steps: a 30-step run's mean would be a third warm-up."""
    import json

    from distlion.costmodel import calibrate
    from distlion.report import load_runs, steady_phase_times

    write_timed_run(tmp_path, "ddp", "100mbit", 0.5, 30, [0.5] * 7)
    run_dir = tmp_path / "ddp-100mbit"
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "method.start_iter": 10}))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in lines[:9]:  # steps 1-9: 4 s each and 32 bits, as PowerSGD's fp32 warm-up
        line.update(time_step=4.0, time_comm=3.75, bits_up_per_param=32.0, bits_down_per_param=32.0)
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (run,) = load_runs(tmp_path)
    assert steady_phase_times(run)["time_step"] == 0.5  # steps 12-30: from start_iter on, then 2 start-up lines out
    calibration = calibrate(run_dir)
    assert calibration.comm == 0.25 and calibration.transfers[0].payload == 100  # 1 bit x 800 params, in bytes


def test_a_simulated_run_on_a_link_it_never_used(tmp_path):
    """One rank's step: the simulated process computed and encoded for all 4 workers (/ 4), ran the server rule and
    the update once, plus the exchange's bytes at the link's rate, once per sync: LocalSGD at H = 10 (3.2 bits per
    parameter per iteration: 32 per sync) all-gathers 4,000 bytes from each of 4 workers every 10 steps; each rank
    receives 3 x 4,000."""
    from distlion.wallclock import link_of, modelled_step, rank_compute

    times = {"time_compute": 0.1, "time_encode": 0.01, "time_comm": 0.002, "time_apply": 0.003, "time_step": 0.115}
    lines = [{"step": s, "bits_up_per_param": 0.0, "bits_down_per_param": 0.0, **times} for s in range(10, 60, 10)]
    run = {"method": "localsgd", "exchange": "allgather", "workers": 4, "num_params": 1000,
           "bits_up_per_param_per_iter": 3.2, "bits_down_per_param_per_iter": 3.2, "method.sync_every": 10,
           "steps": 50, "backend": "simulated", "curve": lines}
    gbit = 1e9 * 1448 / 1514  # TCP payload on a 1 Gbit/s link
    rank = 0.1 / 4 + 0.01 / 4 + 0.002 + 0.003
    assert rank_compute(run) == pytest.approx(0.025)
    assert modelled_step(run, link_of("1gbit")) == pytest.approx(rank + 3 * 4000 * 8 / gbit / 10)
    assert modelled_step(run, Link(None)) == pytest.approx(rank)  # an uncapped link: no transfer time
    # The report's common compute (the median over its runs) replaces the run's own.
    assert modelled_step(run, Link(None), compute=0.04) == pytest.approx(rank - 0.025 + 0.04)
    # A torchrun rank measured its own worker only: nothing is divided.
    assert modelled_step({**run, "backend": "torchdist"}, Link(None)) == pytest.approx(0.115)
    # 55 steps ending on a sync (train.final_sync): 6 exchanges of 32 bits per parameter, 6 x 64 / 55 per iteration.
    final = {**run, "steps": 55, "syncs": 6, "bits_up_per_param_per_iter": 6 * 32 / 55,
             "bits_down_per_param_per_iter": 6 * 32 / 55}
    assert modelled_step(final, link_of("1gbit")) == pytest.approx(rank + 3 * 4000 * 8 / gbit * 6 / 55)
    # A run recorded before `syncs` (55 steps at H = 10, the last 5 unsynced): 5 exchanges of 32 bits.
    old = {**run, "steps": 55, "bits_up_per_param_per_iter": 5 * 32 / 55, "bits_down_per_param_per_iter": 5 * 32 / 55}
    assert modelled_step(old, link_of("1gbit")) == pytest.approx(rank + 3 * 4000 * 8 / gbit * 5 / 55)
    never = {**run, "steps": 5, "syncs": 0, "bits_up_per_param_per_iter": 0.0, "bits_down_per_param_per_iter": 0.0}
    assert modelled_step(never, link_of("1gbit")) == pytest.approx(rank)  # shorter than H, no final sync


def test_modelled_time_takes_one_compute_time_for_every_method(tmp_path):
    """A run slowed by another process on the shared cores (3x the compute) is modelled at the median compute of
    the runs of its shape, so two methods that differ only in that contention come out equal."""
    from distlion.wallclock import write_modelled

    def run(method: str, compute: float, seed: int) -> dict:
        times = {"time_compute": compute, "time_encode": 0.0, "time_comm": 0.0, "time_apply": 0.0, "time_step": 1}
        curve = [{"step": s, "val_accuracy": 0.5, "bits_up_per_param": 1.0, "bits_down_per_param": 1.0, **times}
                 for s in range(10, 60, 10)]
        return {"method": method, "label": method, "task": "digits", "workers": 4, "per_worker_batch": 8,
                "num_params": 1000, "exchange": "sharded", "bits_up_per_param_per_iter": 1.0,
                "bits_down_per_param_per_iter": 1.0, "backend": "simulated", "seed": seed, "curve": curve,
                "metrics": (Metric("val_accuracy", "validation accuracy (%)", "validation", True, 100.0),),
                "run_dir": str(tmp_path)}

    runs = [run("dlion", 0.4, s) for s in range(3)] + [run("signum", 1.2, s) for s in range(3)]
    markdown = write_modelled(runs, tmp_path, ["1gbit"])
    rows = [line.split("|") for line in markdown.splitlines() if line.startswith("| ") and "s/step" not in line]
    assert len(rows) == 2 and rows[0][2:4] == rows[1][2:4]  # the same compute and modelled step
    assert float(rows[0][2]) == pytest.approx(statistics.median([0.1] * 3 + [0.3] * 3))
