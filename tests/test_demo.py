"""DeMo against a naive implementation written once here (scipy's DCT, chunk by chunk, float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.fft import dct, idct

from distlion import Simulation
from distlion.methods.demo import dct_matrix

LAYOUT = [(7, 13), (13,), (5,)]


def test_the_dct_matrix_is_scipys_orthonormal_dct_ii():
    basis = dct_matrix(16).double()
    x = torch.randn(5, 16, dtype=torch.float64)
    assert torch.allclose(basis @ basis.T, torch.eye(16, dtype=torch.float64), atol=1e-6)
    assert np.allclose((x @ basis.T).numpy(), dct(x.numpy(), type=2, norm="ortho", axis=1), atol=1e-5)


def naive_demo(params, grads_per_step, lr, wd, beta, chunk, topk):
    """Per layer and chunk: m = beta m + g; DCT; keep the topk largest |c|; m -= IDCT(kept); the workers' mean of
    the kept coefficients, IDCT, sign; x -= lr (sign + wd x)."""
    x = [p.double().numpy().copy() for p in params]
    workers = len(grads_per_step[0])
    momentum = [[np.zeros(p.size) for p in x] for _ in range(workers)]
    for grads in grads_per_step:
        for layer, p in enumerate(x):
            size = p.size
            padded = math.ceil(size / chunk) * chunk
            total = np.zeros(padded)
            for w in range(workers):
                m = momentum[w][layer] = beta * momentum[w][layer] + grads[w][layer].double().numpy().reshape(-1)
                chunks = np.zeros(padded)
                chunks[:size] = m
                coefficients = dct(chunks.reshape(-1, chunk), type=2, norm="ortho", axis=1)
                kept = np.zeros_like(coefficients)
                for row in range(coefficients.shape[0]):
                    top = np.argsort(-np.abs(coefficients[row]), kind="stable")[:topk]
                    kept[row, top] = coefficients[row, top]
                momentum[w][layer] = m - idct(kept, type=2, norm="ortho", axis=1).reshape(-1)[:size]
                total += kept.reshape(-1)
            direction = idct((total / workers).reshape(-1, chunk), type=2, norm="ortho", axis=1).reshape(-1)[:size]
            x[layer] = (p.reshape(-1) * (1 - lr * wd) - lr * np.sign(direction)).reshape(p.shape)
    return x, momentum


@pytest.mark.parametrize(("workers", "chunk", "topk"), [(3, 8, 2), (1, 16, 3), (4, 4, 4)])
def test_demo_follows_the_naive_implementation(workers, chunk, topk):
    gen = torch.Generator().manual_seed(workers)
    params = [torch.randn(s, generator=gen) for s in LAYOUT]
    grads = [[[torch.randn(s, generator=gen) for s in LAYOUT] for _ in range(workers)] for _ in range(4)]
    lr, wd, beta = 1e-2, 0.1, 0.9
    sim = Simulation("demo", params, workers, lr=lr, weight_decay=wd, beta=beta, chunk=chunk, topk=topk)
    for step in grads:
        sim.step(step)
    expected, momentum = naive_demo(params, grads, lr, wd, beta, chunk, topk)
    for got, want in zip(sim.params, expected, strict=True):
        assert np.allclose(got.double().numpy(), want, atol=1e-6)
    states = sim.cluster.worker_states[torch.float32]
    for w in range(workers):
        flat = np.concatenate(momentum[w])
        assert np.allclose(states[w]["momentum"].double().numpy(), flat, atol=1e-4)


def test_what_was_sent_leaves_the_momentum():
    """With every coefficient sent, the momentum is emptied each step and DeMo is signSGD of the mean gradient."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in LAYOUT]
    sim = Simulation("demo", params, 2, lr=1e-2, chunk=4, topk=4)
    grads = [[torch.randn(s, generator=gen) for s in LAYOUT] for _ in range(2)]
    before = [p.clone() for p in sim.params]
    sim.step(grads)
    for state in sim.cluster.worker_states[torch.float32]:
        assert state["momentum"].abs().max() < 1e-5
    for p0, p1, g0, g1 in zip(before, sim.params, *grads, strict=True):
        assert torch.allclose(p1, p0 - 1e-2 * torch.sign(g0 + g1), atol=1e-7)


def test_bad_chunk_and_topk_are_refused():
    with pytest.raises(ValueError, match=r"method.chunk=300 must be a whole number in \[2, 256\]"):
        Simulation("demo", [torch.zeros(4)], 2, lr=1e-3, chunk=300)
    with pytest.raises(ValueError, match=r"method.topk=9 must be a whole number in \[1, method.chunk=8\]"):
        Simulation("demo", [torch.zeros(4)], 2, lr=1e-3, chunk=8, topk=9)
