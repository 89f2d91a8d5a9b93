"""Bit packing: 8 bits per byte, little-endian within a byte (element 8k+j is bit j of byte k).

Unsigned integers of width w are packed as w bit-planes (plane j holds bit j of every element),
so a vote counter, a TernGrad code or an Avg sum costs w bits per element plus at most 7 bits of
padding per plane, and the bit-sliced vote in `voting.py` works on the planes directly.
"""

from __future__ import annotations

import functools

import torch

# A word of 8 bool bytes (element j in byte j) times this constant puts element j at bit 56 + j; the
# partial products never collide or carry, so the top byte is the packed byte (the int64 wrap is harmless).
_GATHER = 0x0102040810204080


@functools.cache
def _spread(device: torch.device) -> torch.Tensor:
    """Row b is byte b's 8 bits spread one per byte, read as one int64 word: unpacking is a single gather. One
    table per device, made once (not copied to a GPU at every unpacking)."""
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    return bits.to(torch.uint8).view(torch.int64).squeeze(1)


def packed_size(numel: int) -> int:
    """Bytes that hold `numel` bits."""
    return (numel + 7) // 8


def as_words(data: torch.Tensor) -> torch.Tensor:
    """Bytes (uint8 or bool) [..., B] as int64 words [..., ceil(B/8)], so one op covers 64 bits.

    A view when every row starts on a word boundary and B is whole words (never write to it),
    otherwise a copy zero-padded to whole words.
    """
    data = data.view(torch.uint8)
    num_bytes = data.shape[-1]
    if data.numel() == 0:
        return torch.zeros(*data.shape[:-1], packed_size(num_bytes), dtype=torch.int64, device=data.device)
    aligned = data.stride(-1) == 1 and all(stride % 8 == 0 for stride in data.stride()[:-1])
    if num_bytes % 8 or data.storage_offset() % 8 or not aligned:
        padded = data.new_zeros(*data.shape[:-1], packed_size(num_bytes) * 8)
        padded[..., :num_bytes] = data
        data = padded
    return data.view(torch.int64)


def pack_bits(bits: torch.Tensor, overwrite: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack a bool tensor [..., n] into uint8 [..., ceil(n/8)]; padding bits are 0.

    `overwrite=True`: `bits` is a scratch mask this call may use as its working words (garbage afterwards), so
    nothing is allocated but the packed result (a copy is made as before where its words are not a view).
    `out`: a uint8 tensor of the result's shape to write it into (then nothing is allocated at all).
    """
    if bits.dtype != torch.bool:
        bits = bits != 0
    words = as_words(bits)
    if overwrite and words.data_ptr() == bits.data_ptr():
        words.mul_(_GATHER)
    else:
        words = words * _GATHER
    words >>= 56
    return words.to(torch.uint8) if out is None else out.copy_(words)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 [..., B] -> bool [..., numel]."""
    index = packed.reshape(-1).to(torch.int32)
    words = torch.index_select(_spread(packed.device), 0, index)
    return words.view(torch.bool).view(*packed.shape[:-1], 8 * packed.shape[-1])[..., :numel]


@functools.cache
def _sign_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Row b: byte b's 8 bits as +1 (bit set) or -1, in `dtype`."""
    return ((torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1).to(dtype).mul_(2).sub_(1)


def unpack_signs(packed: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
    """`pack_bits`' inverse as signs: bit 1 -> +1, bit 0 -> -1, in `out`'s dtype, through one gather of 8
    values per byte from a 256-row table (no bool tensor in between). `out` holds 8 x packed.numel() elements
    (the padding bits land past `numel`); returns its first `numel`."""
    if out.numel() != 8 * packed.numel():
        raise ValueError(f"out holds {out.numel()} elements, not 8 x {packed.numel()} packed bytes")
    table = _sign_table(out.dtype, out.device)
    torch.index_select(table, 0, packed.reshape(-1).to(torch.int32), out=out.view(-1, 8))
    return out[:numel]


def uint_width(max_value: int) -> int:
    """Bits needed for the integers 0..max_value, i.e. ceil(log2(max_value + 1))."""
    return max(1, int(max_value).bit_length())


def pack_uint(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative integers [n] (each < 2**width) into bit-planes uint8 [width, ceil(n/8)]."""
    if values.numel():
        low, high = (int(v) for v in torch.aminmax(values))
        if low < 0 or high >= 1 << width:
            raise ValueError(f"values in [{low}, {high}] do not fit in {width} unsigned bits")
    # Up to 8 bits the planes are cut from bytes rather than int64s: 8x less memory traffic.
    dtype = torch.uint8 if width <= 8 else torch.int64
    shifts = torch.arange(width, dtype=dtype, device=values.device)[:, None]
    return pack_bits((values.to(dtype) >> shifts) & 1)


def unpack_uint(planes: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_uint`: bit-planes uint8 [w, B] -> int64 [numel]."""
    width = planes.shape[0]
    # Up to 8 planes the integers are assembled one byte each (8x less traffic than int64), then widened.
    dtype = torch.uint8 if width <= 8 else torch.int64
    bits = unpack_bits(planes, numel).to(dtype)
    out = torch.zeros(numel, dtype=dtype, device=planes.device)
    for j in range(width):
        bits[j] <<= j
        out |= bits[j]
    return out.to(torch.int64)


def alternating_bits(num_bytes: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Packed tie-break pattern: element i gets bit 1 (+1) iff (i + step) is even.

    Used for the two ties the paper leaves open (a worker's sign of 0, a MaVo sum of 0): each
    coordinate alternates +1/-1 from step to step, so a tie moves a parameter by at most lr and
    the moves cancel instead of drifting one way.
    """
    return torch.full((num_bytes,), alternating_byte(step), dtype=torch.uint8, device=device)


def alternating_byte(step: int) -> int:
    """The byte `alternating_bits` repeats at `step`: bits 0, 2, 4, 6 (even elements) set on even steps."""
    return 0x55 if step % 2 == 0 else 0xAA
