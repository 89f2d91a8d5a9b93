"""Server rules on packed sign bits: a bit-sliced counter across workers, and the majority vote.

The N workers' packed signs are never unpacked to one byte per sign. A carry-save adder tree adds
worker rows as whole 64-bit words, so 64 coordinates are counted by one integer op; the counter's
bit-planes are exactly the Avg downlink message, and MaVo compares them with N/2, also as words.
"""

from __future__ import annotations

import math

import torch

from distlion.comm.packing import alternating_bits, alternating_byte, as_words, uint_width, unpack_bits

_CPU_CHUNK_BYTES = 1 << 18


def _full_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Three bits per lane -> (sum, carry), 5 word ops and 2 new buffers; the inputs are left untouched.

    carry = majority(a, b, c) = c ^ ((a ^ c) & (b ^ c)), and sum = a ^ (b ^ c) reuses b ^ c.
    """
    carry = a ^ c
    total = b ^ c
    carry &= total
    carry ^= c
    total ^= a
    return total, carry


def _count_words(words: torch.Tensor) -> list[torch.Tensor]:
    """Bit-sliced population count over dim 0 of int64 words [N, W] -> planes (LSB first).

    A carry-save (Wallace) tree: in each column of equal weight, full adders turn 3 terms into a
    sum of the same weight and a carry of the next, until one term (the plane) is left. N rows cost
    about 2.5N word ops (26 for N = 8) and no data-dependent branch; adding rows one at a time into
    a ripple counter costs up to 3N log2(N + 1).
    """
    columns = [list(words)]
    planes = []
    while len(planes) < len(columns):
        terms, carries = columns[len(planes)], []
        while len(terms) > 1:
            if len(terms) >= 3:
                total, carry = _full_add(terms.pop(0), terms.pop(0), terms.pop(0))
            else:
                a, b = terms.pop(0), terms.pop(0)
                total, carry = a ^ b, a & b
            terms.append(total)
            carries.append(carry)
        planes.append(terms[0])
        if carries:
            columns.append(carries)
    return planes


def _byte_chunks(packed: torch.Tensor) -> list[slice]:
    """The byte ranges of packed [N, B] that the counter works through one at a time.

    On CPU, 256 KiB per worker row: the tree's temporaries stay in L2 and reuse freed heap memory
    instead of page-faulting fresh buffers, and 32768 words is torch's parallel grain size, so each op
    runs inline (on shared cores, an OpenMP region waiting for a descheduled thread cost 100x).
    """
    num_bytes = packed.shape[-1]
    step = _CPU_CHUNK_BYTES if packed.device.type == "cpu" else max(num_bytes, 1)
    return [slice(start, min(start + step, num_bytes)) for start in range(0, num_bytes, step)]


def count_votes(packed: torch.Tensor) -> torch.Tensor:
    """Per coordinate, how many of the N workers sent bit 1 (+1).

    packed: uint8 [N, B] packed signs. Returns the counts as bit-planes uint8 [w, B] with
    w = ceil(log2(N + 1)), the Avg server's downlink message (unpack with `unpack_uint`).
    """
    num_workers, num_bytes = packed.shape
    out = packed.new_empty(uint_width(num_workers), num_bytes)
    for chunk in _byte_chunks(packed):
        for j, plane in enumerate(_count_words(as_words(packed[:, chunk]))):
            out[j, chunk] = plane.view(torch.uint8)[: chunk.stop - chunk.start]
    return out


def majority_vote(packed: torch.Tensor, tie: torch.Tensor | None = None) -> torch.Tensor:
    """MaVo, Delta = sign(sum_i delta_i), on packed signs uint8 [N, B] -> packed uint8 [B].

    A coordinate gets bit 1 when more than N/2 workers sent +1. With even N a sum of 0 takes its
    bit from `tie` (packed uint8 [B]); without `tie`, ties go to -1 (bit 0).
    """
    num_workers, num_bytes = packed.shape
    use_tie = num_workers % 2 == 0 and tie is not None
    if use_tie and tie.shape != (num_bytes,):
        raise ValueError(f"tie has shape {tuple(tie.shape)}, expected ({num_bytes},)")
    # count > N//2 is the carry out of count + k with k = 2**w - 1 - N//2, one word op per plane. A tie
    # enters as the carry in: with even N, count + tie > N/2 exactly when count > N/2, or count = N/2
    # and the tie bit is 1 (the tie pattern is one extra voter, so the N + 1 voters never tie).
    k = (1 << uint_width(num_workers)) - 1 - num_workers // 2
    vote = packed.new_empty(num_bytes)
    for chunk in _byte_chunks(packed):
        carry = as_words(tie[chunk]) if use_tie else None
        for j, plane in enumerate(_count_words(as_words(packed[:, chunk]))):
            if (k >> j) & 1:
                carry = plane if carry is None else plane | carry
            elif carry is not None:
                carry = plane & carry
        vote[chunk] = carry.view(torch.uint8)[: chunk.stop - chunk.start]
    return vote


def unpack_and_sum(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Reference rule: unpack every worker's signs to +-1 and sum them, int64 [numel]."""
    signs = unpack_bits(packed, numel).to(torch.int64) * 2 - 1
    return signs.sum(dim=0)


def majority_vote_counts(sent: list[torch.Tensor], vote: torch.Tensor, numel: int,
                         num_workers: int) -> dict[str, torch.Tensor]:
    """What a majority vote says about itself, from the packed signs this process sent (uint8 [B] each) and the
    packed vote (no communication): `agree2`, 2 x the (worker, coordinate) pairs whose sign is the voted one;
    `signs`, their number; and, when every worker's signs are here, `margins`, the coordinates by
    |sum of the N signs| = |2 (#plus) - N|, [N + 1]. The counts `Cluster.diagnostics` sums over processes."""
    signs = [unpack_bits(s, numel) for s in sent]
    voted = unpack_bits(vote, numel)
    out = {"agree2": sum(2 * (s == voted).sum() for s in signs),  # on the signs' device, one sync at the end
           "signs": torch.tensor(len(sent) * numel, device=vote.device)}
    if len(sent) == num_workers:
        plus = torch.stack(signs).sum(0)
        out["margins"] = torch.bincount((2 * plus - num_workers).abs(), minlength=num_workers + 1)
    return out


def chance_agreement(num_workers: int) -> float:
    """The vote agreement of N independent fair signs: the expected fraction of them equal to their majority
    (a tie agrees with half), sum_k C(N, k) max(k, N - k) / (N 2^N). Not 50%: 0.75 at N = 2 and 3, 0.637 at 8,
    -> 1/2 + 1/sqrt(2 pi N). A measured agreement near it says the workers' signs carry no more common
    direction than coins would."""
    n = num_workers
    return sum(math.comb(n, k) * max(k, n - k) for k in range(n + 1)) / (n * 2**n)


TIE_RULES = ("alternate", "positive", "negative")


def tie_bits(rule: str, num_bytes: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The packed bits a tie takes under `rule`: "alternate" (+1 where index + step is even, see
    `alternating_bits`), "positive" (all +1) or "negative" (all -1, returned as None: no bit to set)."""
    if rule == "alternate":
        return alternating_bits(num_bytes, step, device)
    byte = tie_byte(rule, step)
    return None if byte == 0 else torch.full((num_bytes,), byte, dtype=torch.uint8, device=device)


def tie_byte(rule: str, step: int) -> int:
    """`tie_bits` as the one byte it repeats (every pattern is the same in every byte), 0 for "negative"."""
    if rule == "alternate":
        return alternating_byte(step)
    if rule in ("positive", "negative"):
        return 0xFF if rule == "positive" else 0
    raise ValueError(f"tie rule {rule!r} is unknown; choose one of {TIE_RULES}")
