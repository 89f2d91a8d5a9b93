"""Bit packing: round trips, the pinned bit order, zero padding, bit-planes, and the tie pattern."""

from __future__ import annotations

import math

import pytest
import torch

from distlion.comm.packing import (
    alternating_bits,
    as_words,
    pack_bits,
    pack_uint,
    packed_size,
    uint_width,
    unpack_bits,
    unpack_signs,
    unpack_uint,
)

SIZES = [0, 1, 7, 8, 9, 63, 64, 65, 1001]


def naive_pack(bits: torch.Tensor) -> torch.Tensor:
    """Independent reference: byte k = sum_j bits[8k + j] * 2**j, one Python int at a time."""
    flat = bits.reshape(math.prod(bits.shape[:-1]), bits.shape[-1]).tolist()
    rows = [
        [sum(bit << j for j, bit in enumerate(row[k : k + 8])) for k in range(0, len(row), 8)] for row in flat
    ]
    return torch.tensor(rows, dtype=torch.uint8).reshape(*bits.shape[:-1], packed_size(bits.shape[-1]))


def test_bit_order_is_pinned_little_endian_within_a_byte():
    bits = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    assert pack_bits(bits).tolist() == [0x0D, 0x01]
    assert unpack_bits(torch.tensor([0x0D, 0x01], dtype=torch.uint8), 9).tolist() == bits.tolist()
    assert pack_bits(torch.tensor([0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool)).tolist() == [0x80]


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_pack_matches_reference_and_round_trips(numel, lead):
    bits = torch.rand(*lead, numel, generator=torch.Generator().manual_seed(numel)) < 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, packed_size(numel))
    assert torch.equal(packed, naive_pack(bits))
    unpacked = unpack_bits(packed, numel)
    assert unpacked.dtype == torch.bool and torch.equal(unpacked, bits)


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_unpack_signs_is_plus_one_where_a_bit_is_set_and_minus_one_elsewhere(numel, dtype):
    bits = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.5
    packed = pack_bits(bits)
    out = torch.full((8 * packed.numel(),), 7.0, dtype=dtype)
    signs = unpack_signs(packed, numel, out=out)
    assert signs.dtype == dtype and signs.data_ptr() == out.data_ptr()  # written in place, no copy
    assert signs.tolist() == [1.0 if b else -1.0 for b in bits.tolist()]
    with pytest.raises(ValueError, match="8 x"):
        unpack_signs(packed, numel, out=torch.empty(8 * packed.numel() + 1, dtype=dtype))


@pytest.mark.parametrize("numel", [1, 9, 64, 1000])
def test_pack_bits_overwriting_its_scratch_mask_packs_the_same(numel):
    bits = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.5
    scratch = bits.clone()
    assert torch.equal(pack_bits(scratch, overwrite=True), naive_pack(bits))
    aligned = numel % 8 == 0  # its words are a view: the mask is used as scratch, else a copy is
    assert torch.equal(scratch, bits) != aligned


@pytest.mark.parametrize("numel", [1, 7, 9, 1001])
def test_padding_bits_are_zero(numel):
    packed = pack_bits(torch.ones(numel, dtype=torch.bool))
    assert torch.equal(unpack_bits(packed, 8 * packed.numel()), torch.arange(8 * packed.numel()) < numel)


def test_pack_accepts_unaligned_and_non_bool_input():
    bits = torch.rand(100, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(pack_bits(bits[3:84]), naive_pack(bits[3:84]))  # a view not on a word boundary
    assert torch.equal(pack_bits(bits[::2]), naive_pack(bits[::2]))  # strided
    assert torch.equal(pack_bits(bits.to(torch.int64) * 5), naive_pack(bits))  # nonzero means 1


def test_as_words_views_aligned_rows_and_copies_the_rest():
    data = torch.arange(48, dtype=torch.uint8).reshape(3, 16)
    words = as_words(data[:, 8:])
    assert words.shape == (3, 1) and words.data_ptr() == data[0, 8:].data_ptr()  # no copy
    odd = as_words(data[:, 1:12])
    assert odd.shape == (3, 2)
    assert torch.equal(odd.view(torch.uint8)[:, :11], data[:, 1:12])
    assert not odd.view(torch.uint8)[:, 11:].any()  # zero padding


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("numel", [0, 1, 7, 9, 1001])
def test_uint_bit_planes_round_trip(width, numel):
    values = torch.randint(0, 1 << width, (numel,), generator=torch.Generator().manual_seed(width))
    planes = pack_uint(values, width)
    assert planes.shape == (width, packed_size(numel))
    for j in range(width):  # plane j is bit j of every element
        assert torch.equal(planes[j], naive_pack((values >> j) & 1))
    assert torch.equal(unpack_uint(planes, numel), values)


@pytest.mark.parametrize("num_workers", [1, 2, 3, 8, 15, 16, 33, 63, 64])
def test_uint_width_holds_counts_up_to_n(num_workers):
    width = uint_width(num_workers)
    assert width == len(bin(num_workers)) - 2
    values = torch.arange(num_workers + 1).repeat(3)  # 0..N, length not a multiple of 8 for most N
    assert torch.equal(unpack_uint(pack_uint(values, width), values.numel()), values)
    with pytest.raises(ValueError):
        pack_uint(values, width - 1) if width > 1 else pack_uint(values + 1, width)


def test_wide_uint_round_trip():
    values = torch.tensor([0, 1, 255, 256, 1000, 2**20 - 1])
    assert torch.equal(unpack_uint(pack_uint(values, 20), values.numel()), values)


@pytest.mark.parametrize("values", [[0, 8], [-1, 3], [2**40]])
def test_pack_uint_rejects_values_that_do_not_fit(values):
    with pytest.raises(ValueError):
        pack_uint(torch.tensor(values), 3)


@pytest.mark.parametrize("step", [-3, 0, 1, 2, 7])
def test_alternating_bits_is_plus_one_where_index_plus_step_is_even(step):
    numel = 21
    bits = unpack_bits(alternating_bits(packed_size(numel), step), numel)
    expected = (torch.arange(numel) + step) % 2 == 0
    assert torch.equal(bits, expected)
    assert alternating_bits(3, step).dtype == torch.uint8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_packing_voting_and_sign_unpacking_on_cuda_equal_the_cpu_s():
    """The kernels D-Lion runs on the gradients' device compute on CUDA what they compute on CPU, bit for bit."""
    from distlion.comm.voting import count_votes, majority_vote

    bits = torch.rand(8, 10_001, generator=torch.Generator().manual_seed(0)) < 0.5
    packed = {device: pack_bits(bits.to(device)) for device in ("cpu", "cuda")}
    assert torch.equal(packed["cuda"].cpu(), packed["cpu"])
    assert torch.equal(majority_vote(packed["cuda"]).cpu(), majority_vote(packed["cpu"]))
    assert torch.equal(count_votes(packed["cuda"]).cpu(), count_votes(packed["cpu"]))
    outs = {device: torch.empty(8 * packed["cpu"].shape[1], device=device) for device in ("cpu", "cuda")}
    signs = {device: unpack_signs(packed[device][0], 10_001, out=outs[device]) for device in ("cpu", "cuda")}
    assert torch.equal(signs["cuda"].cpu(), signs["cpu"])
