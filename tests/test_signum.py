"""signSGD with majority vote and momentum (Bernstein et al. 2019): hand-computed, and D-Lion with b1 = b2."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from distlion import Simulation
from distlion.methods import build_method


def test_signum_hand_computed_three_workers():
    """b = 0.5: m_i = g_i / 2 at step 0, then m_i = m_i / 2 + g_i / 2; x moves by -lr * sign(sum of signs)."""
    sim = Simulation("signum", [torch.zeros(4)], num_workers=3, lr=0.1, momentum=0.5)
    g = [[1.0, -2.0, 0.0, 4.0], [3.0, 1.0, 0.0, -1.0], [-1.0, -1.0, 0.0, -1.0]]
    out = sim.step([[torch.tensor(x)] for x in g])
    # Signs +++ / -+- / 000 (all ties: alternate at step 0, +1 at even index) / +-- -> votes +, -, +, -.
    torch.testing.assert_close(out.params[0], torch.tensor([-0.1, 0.1, -0.1, 0.1]), rtol=0, atol=0)
    assert torch.equal(out.worker_states[0]["momentum"], torch.tensor([0.5, -1.0, 0.0, 2.0]))
    g2 = [torch.tensor([-2.0, 3.0, 0.0, 0.0])] * 3
    out = sim.step([[x] for x in g2])
    # m_0 = [0.5 - 2, -1 + 3, 0, 2] / 2 = [-0.75, 1, 0, 1]; m_1 = [-0.25, 1.75, 0, -0.25]; m_2 = [-1.25, 1.25, 0, -.25]
    assert torch.equal(out.worker_states[0]["momentum"], torch.tensor([-0.75, 1.0, 0.0, 1.0]))
    # Signs [-, +, tie, +], [-, +, tie, -], [-, +, tie, -]; the tie at step 1, index 2 is -1 -> votes -, +, -, -.
    torch.testing.assert_close(out.params[0], torch.tensor([0.0, 0.0, 0.0, 0.2]), rtol=0, atol=1e-7)
    assert out.bits_up == [8, 8, 8] and out.bits_down == 8


def test_signum_is_dlion_with_equal_betas():
    """Exact dyadic values (b = 0.5, gradients in {-1, 0, 1}, lr = 2^-6): the two runs agree bitwise,
    ties included."""
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randint(-4, 5, (257,), generator=gen).float() / 8
    signum = Simulation("signum", [x0], num_workers=4, lr=2**-6, momentum=0.5)
    dlion = Simulation("dlion", [x0], num_workers=4, lr=2**-6, betas=(0.5, 0.5))
    for _ in range(12):
        grads = [[torch.randint(-1, 2, (257,), generator=gen).float()] for _ in range(4)]
        a, b = signum.step(grads), dlion.step(grads)
    assert torch.equal(a.params[0], b.params[0]) and not torch.equal(a.params[0], x0)
    assert a.bits_up == b.bits_up and a.bits_down == b.bits_down


def test_signum_config_file_builds_the_documented_defaults(make_cfg):
    cfg = OmegaConf.to_container(make_cfg("method=signum", "~tuned").method)
    method = build_method(cfg.pop("name"), **cfg)
    assert method.hparams() == build_method("signum").hparams()
