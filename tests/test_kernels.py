"""The fused CPU kernels (distlion/kernels/dlion.c): bit for bit the eager ops, or not used at all."""

from __future__ import annotations

import shutil

import pytest
import torch

from distlion import Simulation, kernels
from distlion.comm.packing import pack_bits
from distlion.methods import build_method
from distlion.methods.dlion import checked_kernels, reproduces_eager

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on this machine")


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """The loader as on a fresh machine: an empty build cache, nothing loaded yet."""
    monkeypatch.setenv("DISTLION_CACHE", str(tmp_path))
    for cached in (kernels.library, kernels.dlion, checked_kernels):
        cached.cache_clear()
    yield tmp_path
    for cached in (kernels.library, kernels.dlion, checked_kernels):
        cached.cache_clear()


@needs_compiler
def test_the_kernels_build_and_pass_their_check_here(fresh_kernels):
    assert checked_kernels((0.9, 0.99)) is not None, kernels.status("dlion")
    assert kernels.status("dlion") == "on"
    assert len(list(fresh_kernels.glob("distlion/kernels/dlion-*.so"))) == 1


@pytest.mark.parametrize("setting, reason", [({"DISTLION_KERNELS": "0"}, "DISTLION_KERNELS=0"),
                                             ({"CC": "/no/such/compiler"}, "no C compiler"),
                                             ({"CC": "false"}, "the build failed")])
def test_without_kernels_the_eager_ops_run_and_say_why(fresh_kernels, monkeypatch, setting, reason):
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    method = build_method("dlion", lr=1e-2).bind(torch.zeros(10), 2)
    assert method._kernels is None
    assert reason in kernels.status("dlion")


class _Unfused:
    """A kernel that rounds b1 m + (1-b1) g twice, as a compiler without fma (or with other contraction) would."""

    def rule(self, grad, momentum, signs, betas, tie):
        update = momentum * betas[0] + grad * (1 - betas[0])
        signs.copy_(pack_bits(update > 0) | (pack_bits(update == 0) & tie))
        momentum.lerp_(grad, 1 - betas[1])
        return int((update == 0).sum())

    def apply(self, x, vote, lr, weight_decay):
        kernels.dlion().apply(x, vote, lr, weight_decay)


class _MomentumByMulAdd(_Unfused):
    """Signs right, but the momentum as b2 m + (1-b2) g rather than lerp's formula."""

    def rule(self, grad, momentum, signs, betas, tie):
        kernels.dlion().rule(grad, momentum.clone(), signs, betas, tie)
        momentum.mul_(betas[1]).add_(grad, alpha=1 - betas[1])


@needs_compiler
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.95, 0.98), (0.5, 0.3), (0.0, 0.0)])
def test_the_check_accepts_the_kernels_and_rejects_another_rounding(betas):
    assert reproduces_eager(kernels.dlion(), betas)  # (0.5, 0.3): lerp's other formula, weight >= 0.5
    assert not reproduces_eager(_Unfused(), (0.9, 0.99))
    assert not reproduces_eager(_MomentumByMulAdd(), (0.9, 0.99))


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("zero_sign", ["alternate", "positive", "negative"])
@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
def test_fused_and_eager_runs_are_bitwise_equal(threads, zero_sign, aggregation):
    """Whole simulated runs, fused against eager: parameters, every worker's momentum and the bits, with exact
    zeros (ties) at every step, a size that is no multiple of 8 or of a vector, and enough elements that the
    kernels split the work over `threads` threads (64k elements each at least)."""
    n, workers = 3 * 65536 + 13, 3
    gen = torch.Generator().manual_seed(threads)
    grads = [torch.randn(workers, n, generator=gen) for _ in range(3)]
    for g in grads:
        g[:, ::7] = 0

    def run(fused: bool):
        method = build_method("dlion", lr=1e-2, weight_decay=0.1, aggregation=aggregation, zero_sign=zero_sign)
        method.fused = fused
        sim = Simulation(method, [torch.nn.Parameter(torch.linspace(-1, 1, n))], workers)
        results = [sim.step([[g] for g in step]) for step in grads]
        (bound,) = sim.cluster.buffers[torch.float32].appliers
        assert (bound._kernels is not None) == fused
        momenta = [state["momentum"].clone() for state in results[-1].worker_states]
        return sim.params[0].clone(), momenta, [(r.bits_up, r.bits_down) for r in results]

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, eager = run(True), run(False)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(fused[0], eager[0])
    assert all(torch.equal(a, b) for a, b in zip(fused[1], eager[1], strict=True))
    assert fused[2] == eager[2]


@needs_compiler
def test_the_kernels_refuse_tensors_they_cannot_read():
    fused = kernels.dlion()
    momentum, signs = torch.zeros(16), torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="contiguous torch.float32"):
        fused.rule(torch.zeros(32)[::2], momentum, signs, (0.9, 0.99), 0)
    with pytest.raises(ValueError, match="17 gradients"):
        fused.rule(torch.zeros(17), momentum, signs, (0.9, 0.99), 0)
    with pytest.raises(ValueError, match="3 vote bytes for 16"):
        fused.apply(momentum, torch.zeros(3, dtype=torch.uint8), 1e-3, 0.0)


@needs_compiler
def test_a_bound_method_with_kernels_copies_and_pickles():
    import copy
    import pickle

    method = build_method("dlion", lr=1e-2).bind(torch.zeros(10), 2)
    assert copy.deepcopy(method)._kernels is method._kernels is pickle.loads(pickle.dumps(method))._kernels
