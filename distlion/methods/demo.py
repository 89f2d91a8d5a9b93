"""DeMo, Decoupled Momentum optimization (Peng, Quesnelle and Kingma 2024, arXiv 2411.19870).

Worker i keeps its own momentum m_i (never synchronized) and sends only its fast components:

    m_i = beta m_i + g_i
    c_i = DCT(chunks of m_i)                  each layer cut into chunks of `chunk` entries, orthonormal DCT-II
    q_i = the `topk` largest |c_i| per chunk  (value fp32, index within the chunk uint8: 40 bits each)
    m_i = m_i - IDCT(q_i)                     what was sent leaves the momentum
Server (every rank after the all-gather): the mean over workers of the q_i, sparse (flat int32 index + fp32
value, 64 bits each, over the union U of the sent coefficients) or dense fp32 when that is smaller. Every
worker applies x = x - lr (sign(IDCT(mean q)) + wd x), the paper's signum step.

The paper cuts a matrix into s x s tiles with a 2-D DCT; here every layer is cut along its flat order into 1-D
chunks (the last one zero-padded), the same transform on a layout-agnostic buffer. Bits: up 40 k / n for the
k = topk x C coefficients sent, down min(64 U, 32 n_coef) / n, with n_coef = C s coefficients in C chunks.
"""

from __future__ import annotations

import math

import torch

from distlion.comm.message import Message
from distlion.methods.base import Method, StepContext, check_fraction
from distlion.methods.registry import MethodInfo, register


def dct_matrix(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II basis [size, size]: row k is the k-th cosine, so DCT(x) = D x and IDCT = D^T."""
    j = torch.arange(size, dtype=torch.float64, device=device)
    k = j[:, None]
    basis = torch.cos(math.pi * (2 * j + 1) * k / (2 * size)) * math.sqrt(2 / size)
    basis[0] /= math.sqrt(2)
    return basis.to(torch.float32)


class DeMo(Method):
    """DeMo: top-k DCT components of a decoupled momentum up, their mean's sign applied."""

    name = "demo"
    exchange = "allgather"

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.0, beta: float = 0.999, chunk: int = 64,
                 topk: int = 4):
        super().__init__(lr, weight_decay)
        check_fraction("beta", beta, "the momentum decay; the paper uses 0.999")
        if not (isinstance(chunk, int) and 2 <= chunk <= 256):
            raise ValueError(f"method.chunk={chunk} must be a whole number in [2, 256] (an index fits a byte)")
        if not (isinstance(topk, int) and 1 <= topk <= chunk):
            raise ValueError(f"method.topk={topk} must be a whole number in [1, method.chunk={chunk}]")
        self.beta = float(beta)
        self.chunk = chunk
        self.topk = topk

    def bind(self, params: torch.Tensor, num_workers: int, layout=None) -> Method:
        super().bind(params, num_workers, layout)
        # Where each entry of the flat buffer sits in the chunked layout (each layer padded to whole chunks).
        positions, start = [], 0
        for s in self.layout:
            positions.append(torch.arange(start, start + s.numel, device=params.device))
            start += math.ceil(s.numel / self.chunk) * self.chunk
        self.positions = torch.cat(positions)
        self.num_chunks = start // self.chunk
        self.basis = dct_matrix(self.chunk, params.device)
        return self

    def init_worker_state(self) -> dict[str, torch.Tensor]:
        return {"momentum": torch.zeros_like(self.params, dtype=torch.float32)}

    def to_chunks(self, flat: torch.Tensor) -> torch.Tensor:
        """[n] -> [C, s], each layer zero-padded to whole chunks."""
        chunks = flat.new_zeros(self.num_chunks * self.chunk)
        chunks[self.positions] = flat
        return chunks.view(self.num_chunks, self.chunk)

    def from_chunks(self, chunks: torch.Tensor) -> torch.Tensor:
        """[C, s] -> [n], the padding dropped."""
        return chunks.reshape(-1)[self.positions]

    def worker_rule(self, grad: torch.Tensor, state: dict[str, torch.Tensor], ctx: StepContext) -> Message:
        momentum = state["momentum"].mul_(self.beta).add_(grad)
        coefficients = self.to_chunks(momentum) @ self.basis.T
        index = coefficients.abs().topk(self.topk, dim=1).indices.sort(dim=1).values
        values = coefficients.gather(1, index)
        sent = torch.zeros_like(coefficients).scatter_(1, index, values)
        momentum.sub_(self.from_chunks(sent @ self.basis))
        return Message({"values": values.reshape(-1), "indices": index.to(torch.uint8).reshape(-1)})

    def server_rule(self, messages: list[Message], ctx: StepContext) -> Message:
        total = torch.zeros(self.num_chunks, self.chunk, dtype=torch.float32, device=self.params.device)
        for m in messages:
            total.scatter_add_(1, m["indices"].view(self.num_chunks, self.topk).long(),
                               m["values"].view(self.num_chunks, self.topk))
        total /= len(messages)
        union = total.reshape(-1).nonzero().squeeze(1)
        if 2 * union.numel() < total.numel():
            return Message({"values": total.reshape(-1)[union], "indices": union.to(torch.int32)})
        return Message({"coefficients": total.reshape(-1)})

    def decode(self, down: Message) -> torch.Tensor:
        """The downlink as the dense update direction IDCT(mean q), fp32 [n]."""
        if "coefficients" in down.tensors:
            total = down["coefficients"]
        else:
            total = torch.zeros(self.num_chunks * self.chunk, dtype=torch.float32, device=self.params.device)
            total[down["indices"].long()] = down["values"]
        return self.from_chunks(total.view(self.num_chunks, self.chunk) @ self.basis)

    def apply_rule(self, down: Message, ctx: StepContext) -> None:
        direction = self.decode(down).sign_()
        if self.weight_decay:
            self.params.mul_(1 - ctx.lr * self.weight_decay)
        self.params.add_(direction.to(self.params.dtype), alpha=-ctx.lr)


register(MethodInfo("demo", DeMo, "DeMo", "sparse", "40*k/n", "min(64*U, 32*n_coef)/n", order=11,
                    summary="top-k DCT components of a decoupled momentum, the sign of their mean (Peng et al. 2024)",
                    reference="Peng, Quesnelle and Kingma 2024, arXiv 2411.19870"))
