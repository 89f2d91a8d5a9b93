"""(b) Votes on packed words against unpack-and-sum, N=8, 10M params; (c) pack and unpack throughput."""

from __future__ import annotations

import statistics
import time

import torch

from distlion.comm.packing import alternating_bits, pack_bits, unpack_bits, unpack_uint
from distlion.comm.voting import count_votes, majority_vote, unpack_and_sum

NUMEL = 10_000_000
WORKERS = 8
# One intra-op thread on both sides: on 2 shared cores, two threads made each small op wait for a
# descheduled OpenMP thread (the reference's few large ops suffer far less), which measures the neighbours.
THREADS = 1


def _interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, all timed in turn within each repetition.

    The order rotates between repetitions, so no function always runs right after the same neighbour
    (the reference frees 1.5 GB, and whatever follows it pays for that).
    """
    names = list(fns)
    times = {name: [] for name in names}
    for rep in range(repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run(repeats: int = 7, threads: int = THREADS) -> list[dict]:
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(repeats, threads)
    finally:
        torch.set_num_threads(previous_threads)


def _run(repeats: int, threads: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    bits = torch.rand(WORKERS, NUMEL, generator=generator) < 0.5
    packed = pack_bits(bits)
    tie = alternating_bits(packed.shape[1], step=0)

    # Warm-up, and the packed paths must agree with the reference before they are timed.
    total = unpack_and_sum(packed, NUMEL)
    tie_bits = unpack_bits(tie, NUMEL)
    vote = unpack_bits(majority_vote(packed, tie), NUMEL)
    assert torch.equal(vote, (total > 0) | ((total == 0) & tie_bits))
    assert torch.equal(unpack_uint(count_votes(packed), NUMEL) * 2 - WORKERS, total)
    assert torch.equal(unpack_bits(pack_bits(bits[0]), NUMEL), bits[0])

    med = _interleaved(
        {
            "reference": lambda: unpack_and_sum(packed, NUMEL),
            "mavo": lambda: majority_vote(packed, tie),
            "avg": lambda: count_votes(packed),
            "pack": lambda: pack_bits(bits[0]),
            "unpack": lambda: unpack_bits(packed[0], NUMEL),
        },
        repeats,
    )
    setting = f"N={WORKERS}, {NUMEL // 10**6}M params, {threads} thread(s), median of {repeats}, interleaved"
    ref_ms = med["reference"] * 1e3
    return [
        {
            "name": "(b) MaVo majority_vote on packed words vs unpack_and_sum",
            "value": med["reference"] / med["mavo"],
            "unit": "x faster",
            "target": ">= 20x",
            "detail": f"vote {med['mavo'] * 1e3:.2f} ms vs unpack-and-sum {ref_ms:.0f} ms ({setting})",
        },
        {
            "name": "(b) Avg count_votes on packed words vs unpack_and_sum",
            "value": med["reference"] / med["avg"],
            "unit": "x faster",
            "target": ">= 20x",
            "detail": f"count {med['avg'] * 1e3:.2f} ms vs unpack-and-sum {ref_ms:.0f} ms ({setting})",
        },
        {
            "name": "(c) pack_bits throughput, bool -> packed uint8",
            "value": NUMEL / med["pack"] / 1e9,
            "unit": "Gelem/s",
            "target": "",
            "detail": f"{med['pack'] * 1e3:.2f} ms for {NUMEL // 10**6}M bools ({threads} thread(s))",
        },
        {
            "name": "(c) unpack_bits throughput, packed uint8 -> bool",
            "value": NUMEL / med["unpack"] / 1e9,
            "unit": "Gelem/s",
            "target": "",
            "detail": f"{med['unpack'] * 1e3:.2f} ms for {NUMEL // 10**6}M bools ({threads} thread(s))",
        },
    ]
