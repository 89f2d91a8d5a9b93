"""Bits counted from the messages built, pinned to each method's formula."""

from __future__ import annotations

import math

import pytest
import torch

from distlion import Simulation

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
