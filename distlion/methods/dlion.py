"""Distributed Lion (Liu et al. 2024, arXiv 2404.00438, Algorithm 1)."""

from __future__ import annotations

import functools
import warnings

import torch

import distlion.kernels as kernels
from distlion.comm.message import Message
from distlion.comm.packing import pack_bits, pack_uint, packed_size, uint_width, unpack_bits, unpack_signs, unpack_uint
from distlion.comm.voting import TIE_RULES, count_votes, majority_vote, majority_vote_counts, tie_bits, tie_byte
from distlion.methods.base import Method, StepContext, check_betas, check_choice
from distlion.methods.registry import MethodInfo, register

AGGREGATIONS = ("mavo", "avg")


#: Elements per block of the worker rule on CPU: 1 MB of fp32 update and 256 KB of mask, in L2. A multiple of 64
#: (whole words of mask, whole bytes of signs), so that a block packs exactly the bytes of its elements.
CPU_BLOCK = 1 << 18


class DLion(Method):
    """Distributed Lion: 1-bit signs up, a majority vote (MaVo) or an average (Avg) down.

    Worker i (momentum m_i, never synchronized):
        delta_i = sign(b1 * m_i + (1 - b1) * g_i)        sent packed, 8 signs per byte
        m_i     = b2 * m_i + (1 - b2) * g_i
    Server:
        mavo: Delta = sign(sum_i delta_i)                1 bit per parameter down
        avg:  Delta = (1/N) sum_i delta_i                 the +1 counts, ceil(log2(N+1)) bits down
    Every worker:
        x = x - lr * (Delta + wd * x)

    The two ties the paper leaves open, since one bit cannot carry a 0:
      zero_sign: a worker's b1*m + (1-b1)*g exactly 0;
      mavo_tie:  a MaVo sum of 0 (even N only).
    Both default to "alternate": +1 where (index + step) is even, else -1, so a coordinate with no
    information oscillates by lr instead of drifting (a parameter that never gets a gradient stays
    within lr of where it was). "positive" and "negative" send the tie always to +1 or -1.

    zero_sign="zero" sends the 0 itself, as Lion's `torch.sign` does: a ternary message of two bit-planes
    (the sign, and whether it is nonzero), 2 bits up; the server's result is ternary too (MaVo: sign of the
    sum, 0 for a sum of 0, 2 bits down; Avg: the sum in [-N, N], ceil(log2(2N + 1)) bits down). With one
    worker it is Lion exactly, including coordinates whose update is exactly 0 (an embedding row no token
    of the batch used, before its momentum is nonzero), which the 1-bit settings move by lr. The default
    stays 1 bit: exact zeros are rare in float32 once momenta have started, and they cost a second plane
    every step.
    """

    name = "dlion"
    exchange = "sharded"  # the vote and the count are bytewise, and the tie pattern is the same in every byte

    def __init__(
        self,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        aggregation: str = "mavo",
        zero_sign: str = "alternate",
        mavo_tie: str = "alternate",
    ):
        super().__init__(lr, weight_decay)
        check_choice("aggregation", aggregation, AGGREGATIONS)
        check_choice("zero_sign", zero_sign, (*TIE_RULES, "zero"))
        check_choice("mavo_tie", mavo_tie, TIE_RULES)
        self.betas = check_betas(betas)
        self.aggregation = aggregation
        self.zero_sign = zero_sign
        self.mavo_tie = mavo_tie
        self.fused = True  # False keeps the eager ops (the reference the fused kernels are checked against)

    def bind(self, params: torch.Tensor, num_workers: int, layout=None) -> Method:
        super().bind(params, num_workers, layout)
        self._spread = self._mask = None  # the eager ops' scratch, made when first needed
        # The fused kernels (C on CPU, Triton on CUDA), where they reproduce the eager ops on this device
        # (distlion.kernels); the eager ops else.
        self._kernels = None
        if self.fused and params.dtype == torch.float32 and self.zero_sign != "zero":
            if params.device.type == "cpu":
                self._kernels = checked_kernels(self.betas)
            elif params.device.type == "cuda":
                self._kernels = checked_cuda_kernels(self.betas, params.device)
        return self

    def _scratch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole bytes' worth of elements (the vote unpacks into it with its padding bits) and a bool mask, reused
        across blocks, workers and steps (fresh ones page-fault)."""
        if self._spread is None:
            self._spread = self.params.new_empty(8 * packed_size(self.params.numel()))
            self._mask = torch.empty_like(self.params, dtype=torch.bool)
        return self._spread, self._mask

    def init_worker_state(self) -> dict[str, torch.Tensor]:
        return {"momentum": torch.zeros_like(self.params)}

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        momentum = state["momentum"]
        n = momentum.numel()
        signs = torch.empty(packed_size(n), dtype=torch.uint8, device=momentum.device)
        if self._kernels is not None and grad.dtype == momentum.dtype and grad.is_contiguous():
            self._kernels.rule(grad, momentum, signs, self.betas, tie_byte(self.zero_sign, ctx.step))
            return Message({"signs": signs})
        nonzero = torch.empty_like(signs) if self.zero_sign == "zero" else None
        # On CPU in blocks whose update and mask stay in cache from the first pass over them to the last (the
        # same elementwise ops, so the same bits); on a GPU in one block: there launches cost, not passes.
        block = n if momentum.is_cuda else CPU_BLOCK
        for start in range(0, n, block):
            stop = min(start + block, n)
            self._rule_block(grad[start:stop], momentum[start:stop], signs[start // 8 : (stop + 7) // 8],
                             None if nonzero is None else nonzero[start // 8 : (stop + 7) // 8], ctx.step)
        return Message({"signs": signs} if nonzero is None else {"signs": signs, "nonzero": nonzero})

    def _rule_block(self, grad: torch.Tensor, momentum: torch.Tensor, signs: torch.Tensor,
                    nonzero: torch.Tensor | None, step: int) -> None:
        """The worker rule on one block in eager ops: its packed signs (and nonzero bits) written into `signs`,
        momentum updated in place."""
        beta1, beta2 = self.betas
        n = momentum.numel()
        spread, mask = self._scratch()
        update = torch.mul(momentum, beta1, out=spread[:n]).add_(grad, alpha=1 - beta1)
        pack_bits(torch.gt(update, 0, out=mask[:n]), overwrite=True, out=signs)
        if nonzero is not None:
            pack_bits(torch.ne(update, 0, out=mask[:n]), overwrite=True, out=nonzero)
        # A 0 (a row no token reached): pack the ties; on a GPU without counting them first, which would hold
        # the host until the device caught up, every worker and step.
        elif momentum.is_cuda or int(torch.count_nonzero(update)) < n:
            tie = tie_bits(self.zero_sign, signs.numel(), step, signs.device)  # a block starts on a whole byte
            if tie is not None:
                signs |= pack_bits(torch.eq(update, 0, out=mask[:n]), overwrite=True) & tie
        momentum.lerp_(grad, 1 - beta2)

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        if self.zero_sign == "zero":
            return self._ternary_server_rule(messages)
        if len(messages) == 1:  # one worker's signs are the vote (a sum of one +-1 is never 0) and the count
            signs = messages[0]["signs"]
            return Message({"vote": signs} if self.aggregation == "mavo" else {"counts": signs[None]})
        signs = torch.stack([m["signs"] for m in messages])
        if self.aggregation == "mavo":
            tie = tie_bits(self.mavo_tie, signs.shape[1], ctx.step, signs.device)
            return Message({"vote": majority_vote(signs, tie)})
        return Message({"counts": count_votes(signs)})

    def _ternary_server_rule(self, messages: list[Message]) -> Message:
        """Sum of the workers' {-1, 0, +1}, per coordinate of the packed planes (bytewise, so it shards)."""
        numel = 8 * messages[0]["signs"].shape[-1]
        positive = torch.stack([unpack_bits(m["signs"], numel) for m in messages])
        nonzero = torch.stack([unpack_bits(m["nonzero"], numel) for m in messages])
        total = (positive & nonzero).sum(0) - (~positive & nonzero).sum(0)
        if self.aggregation == "mavo":
            return Message({"vote": pack_bits(total > 0), "nonzero": pack_bits(total != 0)})
        return Message({"sums": pack_uint(total + len(messages), uint_width(2 * len(messages)))})

    def vote_diagnostics(self, sent: list[Message], down: Message, num_workers: int) -> dict[str, torch.Tensor]:
        """What a vote says about itself, from the messages this process sent and the downlink (no communication):

        agree2   2 x the (worker, coordinate) pairs whose sign is the voted one (Avg: the sign of the mean; a tie
                 counts 1 of 2), summed over the local workers; `signs` is their number. Additive over processes.
        margins  coordinates by |sum of the N signs| = |2 (#plus) - N|, [N + 1]: the whole buffer's, where the
                 counts are here (Avg's downlink; MaVo in one process, from all N messages), else absent.
        Binary signs exchanged after backward only (not `zero_sign="zero"`, not the DDP hook's buckets)."""
        if self.zero_sign == "zero" or self.exchange == "in_backward":
            return {}
        n = self.params.numel()
        if self.aggregation == "mavo":
            return majority_vote_counts([m["signs"] for m in sent], down["vote"], n, num_workers)
        plus = unpack_uint(down["counts"], n).long()
        margin = 2 * plus - num_workers  # > 0: the mean is positive
        device = margin.device  # the counts stay where the messages are (all-reduced there): one sync, at the end
        agree2 = torch.zeros((), dtype=torch.int64, device=device)
        for m in sent:
            agree2 += (torch.where(unpack_bits(m["signs"], n), margin, -margin).sign() + 1).sum()
        return {"agree2": agree2, "signs": torch.tensor(len(sent) * n, device=device),
                "margins": torch.bincount(margin.abs(), minlength=num_workers + 1)}

    def delta(self, down: Message, ctx: StepContext) -> torch.Tensor:
        """The downlink as Delta, the update direction every worker applies (in a scratch buffer)."""
        n, num_workers = self.params.numel(), ctx.num_workers
        if self.zero_sign == "zero":
            if self.aggregation == "mavo":  # Delta in {-1, 0, +1}, as Lion's sign
                vote = unpack_bits(down["vote"], n).to(self.params.dtype).mul_(2).sub_(1)
                return vote.mul_(unpack_bits(down["nonzero"], n))
            return unpack_uint(down["sums"], n).sub_(num_workers).to(self.params.dtype).div_(num_workers)
        if self.aggregation == "mavo":  # +-1 straight from the packed bytes, one gather
            return unpack_signs(down["vote"], n, out=self._scratch()[0])
        # sum_i delta_i = 2 * (#plus) - N, divided by N.
        counts = unpack_uint(down["counts"], n).to(self.params.dtype)
        return counts.mul_(2).sub_(num_workers).div_(num_workers)

    def apply_rule(self, down: Message, ctx: StepContext) -> None:
        # -lr * Delta is exact for Delta = +-1, so this rounds as one add of +-lr would.
        if self.aggregation == "mavo" and self._kernels is not None:
            self._kernels.apply(self.params, down["vote"], ctx.lr, self.weight_decay)
            return
        if self.aggregation == "mavo" and self.zero_sign != "zero" and not self.params.is_cuda:
            # MaVo on CPU in blocks, as the worker rule: a block's +-1 are unpacked where the apply reads them.
            n, vote = self.params.numel(), down["vote"]
            for start in range(0, n, CPU_BLOCK):
                stop = min(start + CPU_BLOCK, n)
                packed = vote[start // 8 : (stop + 7) // 8]
                delta = unpack_signs(packed, stop - start, out=self._scratch()[0][: 8 * packed.numel()])
                self.params[start:stop].mul_(1 - ctx.lr * self.weight_decay).add_(delta, alpha=-ctx.lr)
            return
        self.params.mul_(1 - ctx.lr * self.weight_decay)
        self.params.add_(self.delta(down, ctx), alpha=-ctx.lr)

@functools.cache
def checked_kernels(betas: tuple[float, float]) -> kernels.DLionKernels | None:
    """The fused CPU kernels for these betas, if they build here and reproduce the eager ops bit for bit."""
    fused = kernels.dlion()
    if fused is None or reproduces_eager(fused, betas):
        return fused
    why = f"dlion.c rounds otherwise than this machine's torch ops (betas {betas}); the eager ops run"
    kernels.disable("dlion", why)
    warnings.warn(f"distlion: {why}", stacklevel=2)
    return None


@functools.cache
def checked_cuda_kernels(betas: tuple[float, float], device: torch.device):
    """The Triton kernels for these betas on `device`, if Triton compiles them there and they reproduce the eager
    CUDA ops bit for bit on that device (its GPU model, its torch build); None, and `kernels.status("dlion_cuda")`
    saying why, else."""
    fused = kernels.dlion_cuda()
    if fused is None:
        return None
    try:
        same = reproduces_eager(fused, betas, device)
    except Exception as error:  # a Triton that cannot compile for this GPU, a driver too old for its PTX, ...
        lines = str(error).strip().splitlines()
        why = f"the Triton kernels failed on {device} ({type(error).__name__}: {lines[-1] if lines else ''})"
    else:
        if same:
            return fused
        why = f"the Triton kernels round otherwise than the eager ops on {device} (betas {betas})"
    kernels.disable("dlion_cuda", f"{why}; the eager ops run")
    warnings.warn(f"distlion: {why}; the eager ops run", stacklevel=2)
    return None


def reproduces_eager(fused, betas: tuple[float, float], device: torch.device | str = "cpu") -> bool:
    """Whether `fused` gives the eager ops' signs, ties, momenta and MaVo apply on `device`, bit for bit, on a probe
    where rounding decides: half the updates within a few ulps of 0 (g ~ -b1/(1-b1) m), exact zeros, and a length
    that leaves a tail after whole vectors (torch finishes a loop in scalar code). On a GPU also subnormal values
    (a kernel that flushes them to 0 differs there) and a length of several Triton programs."""
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    n = 4096 + 37 if on_cpu else 3 * 4096 + 37
    gen = torch.Generator(device="cpu").manual_seed(0)
    momentum = torch.randn(n, generator=gen, device="cpu")
    momentum *= torch.logspace(-8, 2, n, device="cpu")[torch.randperm(n, generator=gen, device="cpu")]
    grad = torch.randn(n, generator=gen, device="cpu")
    near = torch.rand(n, generator=gen, device="cpu") < 0.5
    ratio = -betas[0] / (1 - betas[0]) if betas[0] < 1 else 0.0
    jitter = torch.rand(int(near.sum()), generator=gen, device="cpu") - 0.5
    grad[near] = momentum[near] * ratio * (1 + jitter * 1e-6)
    grad[::97] = 0
    momentum[::97] = 0
    if not on_cpu:
        momentum[5::89] *= 1e-35  # subnormal momenta, and updates that are subnormal or round to 0
        grad[7::89] *= 1e-39
    params = torch.randn(n, generator=gen, device="cpu")
    momentum, grad, params = momentum.to(device), grad.to(device), params.to(device)
    eager = DLion(lr=1e-3, betas=betas, weight_decay=0.1)
    eager.fused = False
    eager.bind(params, 1)
    for step in (0, 1):  # both phases of the alternating tie
        ctx = StepContext(step=step, lr=3e-3, num_workers=1)
        expected = {"momentum": momentum.clone()}
        signs = eager.worker_rule(grad, expected, ctx)["signs"]
        fused_momentum, fused_signs = momentum.clone(), torch.empty_like(signs)
        fused.rule(grad, fused_momentum, fused_signs, betas, tie_byte("alternate", step))
        if not (torch.equal(signs, fused_signs) and torch.equal(expected["momentum"], fused_momentum)):
            return False
        fused_params = eager.params.clone()
        eager.apply_rule(Message({"vote": signs}), ctx)
        fused.apply(fused_params, signs, ctx.lr, eager.weight_decay)
        if not torch.equal(eager.params, fused_params):
            return False
    return True


register(MethodInfo("dlion", DLion, "D-Lion (MaVo)", "sign", "1 + z", "1 + z", order=13, fixed={"aggregation": "mavo"},
                    summary="`sign(sum_i sign(b1 m_i + (1-b1) g_i))`", reference="Liu et al. 2024, Algorithm 1"))
register(MethodInfo("dlion_avg", DLion, "D-Lion (Avg)", "sign", "1 + z", "ceil(log2((1 + z) * N + 1))", order=12,
                    fixed={"aggregation": "avg"}, summary="`(1/N) sum_i sign(...)`",
                    reference="Liu et al. 2024, Algorithm 1"))
