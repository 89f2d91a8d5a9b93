"""What a vote says of itself: the agreement rate and the margins of |sum of signs| / N, on a hand-made vote."""

from __future__ import annotations

import pytest
import torch

from distlion import Simulation

# 4 workers, 8 coordinates: how many send +1 at each coordinate (step 0, zero momentum: the sign of the gradient).
PLUS = [4, 3, 2, 1, 0, 2, 3, 1]


def hand_made_grads() -> torch.Tensor:
    return torch.tensor([[1.0 if w < c else -1.0 for c in PLUS] for w in range(4)])


@pytest.mark.parametrize("method", ["dlion", "dlion_avg"])
def test_agreement_and_margins_of_a_hand_made_vote(method):
    sim = Simulation(method, [torch.zeros(8)], 4, lr=1e-3)
    bits = sim.cluster.step({torch.float32: hand_made_grads()}, step=0, lr=1e-3, diagnose=True)
    found = sim.cluster.diagnostics(bits)
    # MaVo: + where more than 2 of 4 say +; the ties at coordinates 2 and 5 take the alternating rule's +, -.
    # Agreeing signs per coordinate: 4, 3, 2, 3, 4, 2, 3, 3 = 24 of 32. Avg: the mean's sign, ties half: the same.
    assert found["vote_agreement"] == pytest.approx(24 / 32)
    # |2 (#plus) - 4| = 4, 2, 0, 2, 4, 0, 2, 2
    assert found["vote_margins"] == pytest.approx([2 / 8, 0, 4 / 8, 0, 2 / 8])


def test_the_voted_outer_gradient_of_diloco_reports_its_vote_at_syncs_only():
    # Inner SGD from 0: each worker's outer gradient (global - local) is lr x its gradient, whose signs are the
    # hand-made vote's; the first sync (step 1 with H=2) has no error feedback yet, and a tie (coordinates 2 and 5)
    # agrees with 2 of 4 whichever way it goes: the same 24 of 32 agreeing signs as D-Lion's MaVo.
    sim = Simulation("diloco_sign", [torch.zeros(8)], 4, lr=0.1, sync_every=2, inner="sgd", outer_lr=0.01)
    between = sim.cluster.step({torch.float32: torch.zeros(4, 8)}, step=0, lr=0.1, diagnose=True)
    assert sim.cluster.diagnostics(between) == {}  # no vote between syncs
    synced = sim.cluster.step({torch.float32: hand_made_grads()}, step=1, lr=0.1, diagnose=True)
    found = sim.cluster.diagnostics(synced)
    assert found["vote_agreement"] == pytest.approx(24 / 32)
    assert found["vote_margins"] == pytest.approx([2 / 8, 0, 4 / 8, 0, 2 / 8])
    fp32 = Simulation("diloco", [torch.zeros(8)], 4, lr=0.1, sync_every=1, inner="sgd")
    assert fp32.cluster.diagnostics(fp32.cluster.step({torch.float32: hand_made_grads()}, step=0, lr=0.1,
                                                      diagnose=True)) == {}


def test_without_diagnose_nothing_is_kept_and_other_methods_report_nothing():
    sim = Simulation("dlion", [torch.zeros(8)], 4, lr=1e-3)
    bits = sim.cluster.step({torch.float32: hand_made_grads()}, step=0, lr=1e-3)
    assert bits.exchanged == {} and sim.cluster.diagnostics(bits) == {}
    adamw = Simulation("adamw", [torch.zeros(8)], 4, lr=1e-3)
    bits = adamw.cluster.step({torch.float32: hand_made_grads()}, step=0, lr=1e-3, diagnose=True)
    assert adamw.cluster.diagnostics(bits) == {}


def test_a_run_logs_the_vote_at_every_logged_step(make_cfg, tmp_path):
    import json

    run_cfg = make_cfg("method=dlion", "cluster.workers=3", "train.steps=12", "train.log_every=4",
                       "train.eval_every=12")
    from distlion.train import run

    run(run_cfg, tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [4, 8, 12]
    for line in lines:
        assert 0.5 <= line["vote_agreement"] <= 1  # with 3 workers the majority holds at least 2 of 3
        assert len(line["vote_margins"]) == 4 and sum(line["vote_margins"]) == pytest.approx(1)
        assert line["vote_margins"][0] == line["vote_margins"][2] == 0  # odd N: |sum| is odd
    from distlion.report import write_report

    write_report(tmp_path, tmp_path / "report")
    assert (tmp_path / "report" / "vote_agreement.png").exists()  # the agreement against steps
    # The diagnostics table: the agreement averaged over the second half's logged steps (8 and 12 of 12).
    late = (lines[1]["vote_agreement"] + lines[2]["vote_agreement"]) / 2
    assert f"| D-Lion (MaVo) | — | — | {100 * late:.1f} | 75.0 | 1 |" in (  # 3 fair signs agree 75%
        tmp_path / "report" / "results.md").read_text().splitlines()


def test_the_chance_agreement_is_that_of_hand_counted_and_of_random_votes():
    from distlion.comm.voting import chance_agreement

    # N=2: both agree (2 of 4 patterns) or tie (1 of 2 agrees): (1 + 1/2 + 1/2 + 1) / 4. N=3: 3 of 3 or 2 of 3.
    assert chance_agreement(1) == 1.0
    assert chance_agreement(2) == pytest.approx(0.75)
    assert chance_agreement(3) == pytest.approx((2 * 1 + 6 * 2 / 3) / 8)
    # 8 workers voting fair coins on 200,000 coordinates: the agreement the vote measures is the formula's.
    n = 200_000
    sim = Simulation("dlion", [torch.zeros(n)], 8, lr=1e-3)
    coins = torch.randint(0, 2, (8, n), generator=torch.Generator().manual_seed(0)).float() * 2 - 1
    found = sim.cluster.diagnostics(sim.cluster.step({torch.float32: coins}, step=0, lr=1e-3, diagnose=True))
    assert chance_agreement(8) == pytest.approx(0.63672, abs=1e-5)
    assert found["vote_agreement"] == pytest.approx(chance_agreement(8), abs=0.003)
