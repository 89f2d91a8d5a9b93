"""signSGD with majority vote, with momentum (Signum; Bernstein, Zhao, Azizzadenesheli & Anandkumar,
"signSGD with Majority Vote is Communication Efficient and Fault Tolerant", ICLR 2019, arXiv 1810.05291)."""

from __future__ import annotations

import torch

from distlion.comm.message import Message
from distlion.comm.packing import pack_bits, unpack_bits
from distlion.comm.voting import TIE_RULES, majority_vote, tie_bits
from distlion.methods.base import Method, StepContext, check_choice, check_fraction
from distlion.methods.registry import MethodInfo, register


class SignumVote(Method):
    """Each worker sends the sign of its own momentum; the server votes; every worker steps by the vote.

    Worker i (momentum m_i, never synchronized):   m_i = b * m_i + (1 - b) * g_i;   send sign(m_i)
    Server:                                         Delta = sign(sum_i sign(m_i))
    Every worker:                                   x = x - lr * (Delta + wd * x)
    b = 0 is signSGD with majority vote. This is D-Lion with b1 = b2 = b: the sign is taken after the
    momentum update, not of an interpolation before it. Ties as D-Lion's (`zero_sign`, `vote_tie`).
    """

    name = "signum"
    exchange = "sharded"  # the vote is bytewise on packed signs

    def __init__(
        self,
        lr: float = 1e-4,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        zero_sign: str = "alternate",
        vote_tie: str = "alternate",
    ):
        super().__init__(lr, weight_decay)
        check_fraction("momentum", momentum, "0 is signSGD; the paper uses 0.9")
        check_choice("zero_sign", zero_sign, TIE_RULES)
        check_choice("vote_tie", vote_tie, TIE_RULES)
        self.momentum = float(momentum)
        self.zero_sign = zero_sign
        self.vote_tie = vote_tie

    def init_worker_state(self) -> dict[str, torch.Tensor]:
        return {"momentum": torch.zeros_like(self.params)}

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        m = state["momentum"].lerp_(grad, 1 - self.momentum)
        signs = pack_bits(m > 0)
        tie = tie_bits(self.zero_sign, signs.numel(), ctx.step, signs.device)
        if tie is not None:
            signs |= pack_bits(m == 0) & tie
        return Message({"signs": signs})

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        signs = torch.stack([m["signs"] for m in messages])
        return Message({"vote": majority_vote(signs, tie_bits(self.vote_tie, signs.shape[1], ctx.step, signs.device))})

    def apply_rule(self, down: Message, ctx: StepContext) -> None:
        vote = unpack_bits(down["vote"], self.params.numel()).to(self.params.dtype).mul_(2).sub_(1)
        self.params.mul_(1 - ctx.lr * self.weight_decay).add_(vote, alpha=-ctx.lr)


register(MethodInfo("signum", SignumVote, "Signum (MaVo)", "sign", "1", "1", order=11,
                    summary="`sign(sum_i sign(m_i))`, each worker's own momentum (Bernstein et al. 2019)",
                    reference="Bernstein et al. 2019, arXiv 1810.05291"))
