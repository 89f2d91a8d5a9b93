"""Faulty and adversarial workers: what k of the N workers send in place of their honest uplink.

A fault rewrites the message a worker built after its worker rule ran (so its own state, e.g. Lion
momentum, moves as an honest worker's would) and before the exchange: the server rule and every honest
worker run unmodified code in either backend, and the bits counted are those of the message sent. The
faulty workers are the last k (workers N-k .. N-1); k = 0 changes nothing, not even a random draw.

What each kind sends, by the format of the message (the method's own payload):

  kind     sign bits (D-Lion, Signum)       ternary codes (TernGrad)       values (G-AdamW, G-Lion, DGC, GradDrop,
                                                                           DeMo)
  flip     every sign negated               every code negated             -values
  random   uniform random signs             random signs where nonzero     Gaussian values of the message's RMS
  scaled   unchanged: a bit has no size     unchanged: codes are bounded   values x `scale`
  zero     the tie pattern (what a zero     all codes 0                    zeros
           update sends: no information)
  stale    the message this worker sent at the previous step (at the first step, this step's)

`drop` is `zero` under the name a crashed or silent worker goes by: a server that fills a missing
uplink with nothing gets the same sums. Signum-style voting was shown to tolerate a minority of
flipped workers (Bernstein et al., ICLR 2019); `scaled` is the attack that breaks averaging and that a
one-bit format cannot express. TernGrad's pre-exchange of scalers is left honest (a fault rewrites
the step's uplink only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distlion.comm.message import Message
from distlion.comm.packing import alternating_bits
from distlion.seeding import derive_seed

KINDS = ("flip", "random", "scaled", "zero", "drop", "stale")

# Payload formats by the keys of a method's uplink: the bits of its signs, its ternary codes, its values.
SIGNS, TERNARY, DENSE, SPARSE = ("signs",), ("codes",), ("grad",), ("values", "indices", "dense")
_FAULT_STREAM = 0xFA17  # the random kind's draws: their own stream, apart from every method's


@dataclass(frozen=True)
class FaultSpec:
    """`cluster.faults`: how many workers are faulty (the last k) and what they send."""

    k: int = 0
    kind: str = "flip"
    scale: float = 1000.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"cluster.faults.kind={self.kind!r} is unknown; choose one of {KINDS}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"cluster.faults.k={self.k!r} must be a whole number of faulty workers >= 0")
        if not self.scale > 0:
            raise ValueError(f"cluster.faults.scale={self.scale} must be > 0 (the factor of kind=scaled)")

    @classmethod
    def from_config(cls, cfg: Any) -> FaultSpec:
        """From the cluster config's `faults` node (absent: no faults)."""
        faults = (cfg or {}).get("faults") or {}
        return cls(k=faults.get("k", 0), kind=faults.get("kind", "flip"), scale=float(faults.get("scale", 1000.0)))


class Faults:
    """The faulty workers of a run: rewrites their uplinks, keeps what `stale` resends (checkpointed)."""

    def __init__(self, spec: FaultSpec, num_workers: int, seed: int = 0):
        if spec.k > num_workers:
            raise ValueError(f"cluster.faults.k={spec.k} exceeds cluster.workers={num_workers}; set k <= workers")
        self.spec = spec
        self.seed = seed
        self.faulty = frozenset(range(num_workers - spec.k, num_workers))
        self.previous: dict[str, Message] = {}  # "<buffer>/<worker>" -> the honest message of the last step

    def check(self, method_name: str, exchange: str) -> None:
        if self.spec.k and exchange == "in_backward":
            raise ValueError(f"cluster.faults: method={method_name} exchanges inside DDP's backward, where no "
                             "message of a worker's own is built; set cluster.faults.k=0 or pick another method")

    def corrupt(self, messages: list[Message], workers: list[int], step: int, buffer: str = "") -> list[Message]:
        """The messages the local `workers` send, given the ones they built (one per worker, in order)."""
        if not self.faulty:
            return messages
        return [self.message(m, w, step, buffer) if w in self.faulty else m
                for m, w in zip(messages, workers, strict=True)]

    def message(self, honest: Message, worker: int, step: int, buffer: str = "") -> Message:
        """What faulty `worker` sends at `step` in place of `honest`."""
        kind = "zero" if self.spec.kind == "drop" else self.spec.kind
        keys = tuple(sorted(honest.tensors))
        if kind == "stale":
            key = f"{buffer}/{worker}"
            sent = self.previous.get(key, honest)
            self.previous[key] = Message({k: t.clone() for k, t in honest.tensors.items()})
            return sent
        t = honest.tensors
        generator = None
        if kind == "random":
            device = next(iter(t.values())).device
            generator = torch.Generator(device=device).manual_seed(derive_seed(self.seed, step, worker, _FAULT_STREAM))
        if keys in (SIGNS, ("nonzero", "signs")):
            return Message({**t, "signs": _sign_bits(t["signs"], t.get("nonzero"), kind, step, generator)}
                           | _nonzero_bits(t.get("nonzero"), kind))
        if keys == TERNARY:
            return Message({"codes": _ternary_codes(t["codes"], kind, generator)})
        if keys == DENSE:
            return Message({"grad": _values(t["grad"], kind, self.spec.scale, generator)})
        if keys in (tuple(sorted(SPARSE)), ("indices", "values")):  # DGC, GradDrop; DeMo (no dense part)
            return Message({k: v if k == "indices" else _values(v, kind, self.spec.scale, generator)
                            for k, v in t.items()})
        raise ValueError(f"cluster.faults: no fault model for a message of {list(keys)}; faults cover sign bits "
                         "(D-Lion, Signum), ternary codes (TernGrad) and values (G-AdamW, G-Lion, DGC, GradDrop, DeMo)")

    def summary(self) -> dict[str, Any]:
        """The run summary's record of the faults: k, and the kind (None for honest workers)."""
        return {"faults_k": self.spec.k, "faults_kind": self.spec.kind if self.spec.k else None,
                **({"faults_scale": self.spec.scale} if self.spec.k and self.spec.kind == "scaled" else {})}

    def state_dict(self) -> dict[str, Any]:
        return {"previous": {k: m.tensors for k, m in self.previous.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous = {k: Message(dict(tensors)) for k, tensors in state.get("previous", {}).items()}


def _random_bytes(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, like.shape, dtype=torch.uint8, device=like.device, generator=generator)


def _sign_bits(signs: torch.Tensor, nonzero: torch.Tensor | None, kind: str, step: int,
               generator: torch.Generator | None) -> torch.Tensor:
    """Packed signs (bit = [sign > 0]) as the fault sends them."""
    if kind == "flip":
        return ~signs
    if kind == "random":
        return _random_bytes(signs, generator)
    if kind == "zero" and nonzero is None:  # one bit cannot say 0: the pattern an exact-zero update sends
        return alternating_bits(signs.numel(), step, signs.device).view(signs.shape)
    return signs  # scaled; zero with a nonzero plane (cleared below)


def _nonzero_bits(nonzero: torch.Tensor | None, kind: str) -> dict[str, torch.Tensor]:
    if nonzero is None:
        return {}
    return {"nonzero": torch.zeros_like(nonzero) if kind == "zero" else nonzero}


def _ternary_codes(codes: torch.Tensor, kind: str, generator: torch.Generator | None) -> torch.Tensor:
    """TernGrad's two bit-planes [t = 0], [t = +1] as the fault sends them."""
    zero, plus = codes[0], codes[1]
    if kind == "flip":  # +1 <-> -1, 0 stays: [t' = +1] = [t != 0] and [t != +1]
        plus = ~zero & ~plus
    elif kind == "random":
        plus = ~zero & _random_bytes(plus, generator)
    elif kind == "zero":
        zero, plus = torch.full_like(zero, 0xFF), torch.zeros_like(plus)
    return torch.stack([zero, plus])


def _values(values: torch.Tensor, kind: str, scale: float, generator: torch.Generator | None) -> torch.Tensor:
    if kind == "flip":
        return -values
    if kind == "scaled":
        return values * scale
    if kind == "zero":
        return torch.zeros_like(values)
    if kind == "random":
        rms = values.square().mean().sqrt() if values.numel() else values.new_zeros(())
        return torch.randn(values.shape, dtype=values.dtype, device=values.device, generator=generator) * rms
    return values
