"""Bits counted from the messages built, pinned to each method's formula."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from distlion import Simulation
from distlion.methods import METHODS, method_table, runnable_by

NUMEL = 1001  # not a multiple of 8: the last byte of each packed plane is padding


def one_step_bits(method: str, num_workers: int, **hparams) -> tuple[list[int], int]:
    torch.manual_seed(0)
    sim = Simulation(method, [torch.randn(NUMEL)], num_workers, lr=1e-3, **hparams)
    out = sim.step([[torch.randn(NUMEL)] for _ in range(num_workers)])
    return out.bits_up, out.bits_down


def packed_bits(planes: int) -> int:
    """`planes` bit-planes of NUMEL bits, each padded to whole bytes."""
    return planes * 8 * math.ceil(NUMEL / 8)


@pytest.mark.parametrize("num_workers", [1, 2, 3, 8, 16, 33])
def test_mavo_is_one_bit_up_one_bit_down(num_workers):
    up, down = one_step_bits("dlion", num_workers, aggregation="mavo")
    assert up == [packed_bits(1)] * num_workers
    assert down == packed_bits(1)
    assert 0 <= down - NUMEL <= 7  # at most 7 bits of padding per step


@pytest.mark.parametrize("num_workers", [1, 2, 3, 4, 7, 8, 16, 33])
def test_avg_is_one_bit_up_log2_n_plus_1_down(num_workers):
    up, down = one_step_bits("dlion", num_workers, aggregation="avg")
    assert up == [packed_bits(1)] * num_workers
    assert down == packed_bits(math.ceil(math.log2(num_workers + 1)))


@pytest.mark.parametrize("method", ["adamw", "lion"])
@pytest.mark.parametrize("num_workers", [1, 4])
def test_global_methods_are_32_bits_each_way(method, num_workers):
    up, down = one_step_bits(method, num_workers)
    assert up == [32 * NUMEL] * num_workers
    assert down == 32 * NUMEL


# Every registered method against its registry formula, on a model-like layout (a matrix, a bias, a
# vector: L = 3, n = 109, DGC sends the bias and vector dense) with the symbols read off the messages.
LAYOUT = [(7, 13), (13,), (5,)]


def packed_planes(message) -> int:
    """Bit-planes a message packs (uint8 tensors [..., B]); each may carry up to 7 bits of padding."""
    return sum(math.prod(t.shape[:-1]) for t in message.tensors.values() if t.dtype == torch.uint8)


# The methods that exchange inside backward (DDP's comm hooks) need one process per worker: their
# formulas are pinned over 4 gloo ranks in tests/test_torchdist.py.
SIMULATED = runnable_by("simulated")


# The default of every method, and D-Lion's ternary messages (zero_sign="zero": z = 1 in the formulas).
# Local-update methods sync every step here (H = 1): their per-iteration formula is a mean over H steps, and a
# step between syncs sends nothing (tests/test_local.py).
CASES = ([(name, {"sync_every": 1} if METHODS[name].family == "local" else {}) for name in SIMULATED]
         + [(name, {"zero_sign": "zero"}) for name in ("dlion", "dlion_avg")])


@pytest.mark.parametrize("num_workers", [1, 2, 3, 8])
@pytest.mark.parametrize(("name", "hparams"), CASES)
def test_every_method_moves_the_bits_of_its_registry_formula(name, hparams, num_workers):
    gen = torch.Generator().manual_seed(num_workers)
    sim = Simulation(name, [torch.randn(s, generator=gen) for s in LAYOUT], num_workers, lr=1e-3, **hparams)
    exchanges = []
    exchange = sim.cluster.backend.exchange

    def recording(how, rule, messages):
        reply, bits = exchange(how, rule, messages)
        exchanges.append((messages, reply))
        return reply, bits

    sim.cluster.backend.exchange = recording
    out = sim.step([[torch.randn(s, generator=gen) for s in LAYOUT] for _ in range(num_workers)])
    n, (up, _) = sum(math.prod(s) for s in LAYOUT), exchanges[-1]
    sent = [set(m["indices"].tolist()) if "indices" in m.tensors else set() for m in up]
    if name == "demo":  # indices within a chunk: the coefficient's place is chunk x s + index
        method = sim.cluster.methods[torch.float32]
        chunk_of = torch.arange(method.num_chunks).repeat_interleave(method.topk)
        sent = [set((chunk_of * method.chunk + m["indices"].long()).tolist()) for m in up]
    coefficients = getattr(sim.cluster.methods[torch.float32], "num_chunks", 0) * getattr(
        sim.cluster.methods[torch.float32], "chunk", 0)  # DeMo's padded chunks
    symbols = {"n": n, "N": num_workers, "L": len(LAYOUT), "U": len(set().union(*sent)),
               "n_dense": up[0]["dense"].numel() if "dense" in up[0].tensors else 0,
               "z": int(hparams.get("zero_sign") == "zero"),
               "n_coef": coefficients, "H": hparams.get("sync_every", 1)}
    info = METHODS[name]
    for i, bits in enumerate(out.bits_up):
        expected, _ = info.bits(**symbols, k=len(sent[i]))
        padding = 7 * sum(packed_planes(messages[i]) for messages, _ in exchanges)
        assert 0 <= bits - expected * n <= padding, (i, bits, expected * n)
    _, expected = info.bits(**symbols, k=0)
    assert 0 <= out.bits_down - expected * n <= 7 * sum(packed_planes(reply) for _, reply in exchanges)


def test_the_readme_method_table_is_the_registry_s():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert method_table() in readme, "regenerate README's method table: python -m distlion.methods"


def test_a_run_that_does_not_record_a_setting_counts_the_classs_default_not_a_variants():
    from distlion.methods import method_label

    # ddp_lion fixes optimizer=lion; a run without the setting has the class's default, AdamW.
    assert method_label("ddp", {}) == "DDP AdamW (fp32)"
    assert method_label("ddp", {"optimizer": "lion"}) == "DDP Lion (fp32)"
    assert method_label("dlion", {}) == "D-Lion (MaVo)"
    assert method_label("dlion", {"aggregation": "avg"}) == "D-Lion (Avg)"
