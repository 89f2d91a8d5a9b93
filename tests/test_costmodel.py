"""The alpha-beta step-time model against hand-computed times."""

from __future__ import annotations

import pytest

from distlion.costmodel import Calibration, Link, Transfer, comm_seconds, transfers


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
