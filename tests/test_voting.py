"""Votes on packed words against the plain rule on unpacked signs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distlion.comm import voting
from distlion.comm.packing import (
    alternating_bits,
    pack_bits,
    packed_size,
    uint_width,
    unpack_bits,
    unpack_uint,
)
from distlion.comm.voting import count_votes, majority_vote, unpack_and_sum


@st.composite
def worker_bits(draw, max_workers: int = 33, max_numel: int = 300):
    """Random signs of N workers over n coordinates, with some columns forced to an exact tie."""
    num_workers = draw(st.integers(1, max_workers))
    numel = draw(st.integers(1, max_numel))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    bits = torch.rand(num_workers, numel, generator=generator) < draw(st.sampled_from([0.1, 0.5, 0.9]))
    if num_workers % 2 == 0:
        tied = torch.rand(numel, generator=generator) < 0.3
        half_plus = (
            torch.argsort(torch.rand(num_workers, numel, generator=generator), dim=0) < num_workers // 2
        )
        bits[:, tied] = half_plus[:, tied]
    return bits


def plain_vote(bits: torch.Tensor, tie_bits: torch.Tensor | None) -> torch.Tensor:
    """sign(sum_i delta_i) on +-1 signs; a zero sum takes the tie bit, or -1 without one."""
    total = (bits.to(torch.int64) * 2 - 1).sum(dim=0)
    vote = total > 0
    if tie_bits is not None:
        vote |= (total == 0) & tie_bits
    return vote


@settings(max_examples=150, deadline=None)
@given(bits=worker_bits(), step=st.integers(0, 3))
def test_packed_counts_and_votes_match_the_plain_rule(bits, step):
    num_workers, numel = bits.shape
    packed = pack_bits(bits)

    counts = count_votes(packed)
    assert counts.shape == (uint_width(num_workers), packed_size(numel))
    assert torch.equal(unpack_uint(counts, numel), unpack_bits(packed, numel).sum(dim=0))

    total = unpack_and_sum(packed, numel)
    assert torch.equal(total, (bits.to(torch.int64) * 2 - 1).sum(dim=0))
    tie = alternating_bits(packed_size(numel), step)
    tie_bits = unpack_bits(tie, numel)
    with_tie = unpack_bits(majority_vote(packed, tie), numel)
    assert torch.equal(with_tie, (total > 0) | ((total == 0) & tie_bits))
    assert torch.equal(with_tie, plain_vote(bits, tie_bits))
    assert torch.equal(unpack_bits(majority_vote(packed), numel), total > 0)
    assert torch.equal(unpack_bits(majority_vote(packed, ~tie), numel), plain_vote(bits, ~tie_bits))


@settings(max_examples=40, deadline=None)
@given(bits=worker_bits())
def test_majority_vote_with_odd_n_never_consults_the_tie(bits):
    bits = bits[: bits.shape[0] - 1 + bits.shape[0] % 2]  # drop one worker if N is even
    packed = pack_bits(bits)
    num_bytes = packed.shape[1]
    expected = majority_vote(packed)
    for tie in (torch.full((num_bytes,), 0xFF, dtype=torch.uint8), torch.zeros(num_bytes, dtype=torch.uint8)):
        assert torch.equal(majority_vote(packed, tie), expected)
    # A tie of the wrong shape is never even looked at.
    assert torch.equal(majority_vote(packed, torch.empty(0, dtype=torch.uint8)), expected)


def test_even_n_tie_takes_the_pattern_and_padding_stays_zero():
    # N = 4 workers; how many sent +1 at each of 9 coordinates (one padding byte), ties at 2, 3, 6, 8.
    plus = [4, 3, 2, 2, 1, 0, 2, 3, 2]
    bits = torch.tensor([[i < p for p in plus] for i in range(4)])
    packed = pack_bits(bits)
    assert unpack_uint(count_votes(packed), 9).tolist() == plus
    expected = {
        0: [1, 1, 1, 0, 0, 0, 1, 1, 1],  # a tie is +1 where index + step is even
        1: [1, 1, 0, 1, 0, 0, 0, 1, 0],
    }
    for step, votes in expected.items():
        vote = majority_vote(packed, alternating_bits(2, step))
        assert unpack_bits(vote, 9).tolist() == [bool(v) for v in votes]
        assert not unpack_bits(vote, 16)[9:].any()
    assert unpack_bits(majority_vote(packed), 9).tolist() == [bool(v) for v in [1, 1, 0, 0, 0, 0, 0, 1, 0]]


def test_majority_vote_rejects_a_tie_of_the_wrong_size():
    packed = pack_bits(torch.ones(2, 20, dtype=torch.bool))
    with pytest.raises(ValueError):
        majority_vote(packed, torch.zeros(2, dtype=torch.uint8))


def test_outputs_are_fresh_contiguous_tensors():
    packed = torch.randint(0, 256, (1, 16), dtype=torch.uint8)
    vote = majority_vote(packed)
    assert torch.equal(vote, packed[0]) and vote.data_ptr() != packed.data_ptr()
    counts = count_votes(torch.randint(0, 256, (5, 13), dtype=torch.uint8))
    assert counts.is_contiguous() and counts.shape == (3, 13)


@pytest.mark.parametrize("num_workers", [2, 7, 8])
def test_chunked_counter_matches_one_chunk(monkeypatch, num_workers):
    # The CPU path works through 256 KiB chunks; shrink them so chunk edges and a ragged tail are crossed.
    generator = torch.Generator().manual_seed(num_workers)
    bits = torch.rand(num_workers, 8 * 203 + 5, generator=generator) < 0.5
    packed, numel = pack_bits(bits), bits.shape[1]
    tie = alternating_bits(packed.shape[1], 1)
    monkeypatch.setattr(voting, "_CPU_CHUNK_BYTES", 24)
    assert len(voting._byte_chunks(packed)) == 9
    assert torch.equal(unpack_uint(count_votes(packed), numel), bits.sum(dim=0))
    assert torch.equal(
        unpack_bits(majority_vote(packed, tie), numel), plain_vote(bits, unpack_bits(tie, numel))
    )


def test_rows_from_a_wider_buffer_are_counted_in_place():
    # Rows that are slices of a wider buffer (TernGrad counts codes[:, 0]); odd and word-aligned strides.
    for row_bytes in (13, 16):
        codes = torch.randint(
            0, 256, (6, 2, row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        )
        rows = codes[:, 1]
        numel = 8 * row_bytes
        assert torch.equal(unpack_uint(count_votes(rows), numel), unpack_bits(rows, numel).sum(dim=0))
