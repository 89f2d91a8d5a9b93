"""Deterministic seeds derived from integers: the same in every process, so backends draw the same bits."""

from __future__ import annotations


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (unlike `hash` of strings, stable across processes)."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part) + 1) % (2**63 - 1)
    return seed
