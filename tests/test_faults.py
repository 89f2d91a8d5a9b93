"""Faulty workers (`distlion.comm.faults`): each fault's message by hand, k = 0 changes nothing, a vote outlasts a
flipped minority where a mean follows one scaled worker, and a run with stale workers resumes exactly.

Both backends rewriting the same messages is tests/test_torchdist.py's `*_faulty` runs."""

from __future__ import annotations

import pytest
import torch
from omegaconf import open_dict

from distlion.comm.faults import Faults, FaultSpec
from distlion.comm.message import Message
from distlion.comm.packing import pack_bits, unpack_bits
from distlion.methods import build_method
from distlion.methods.base import StepContext
from distlion.runio import config_hash
from distlion.train import run

N_BITS = 13  # not a whole byte: the padding bits must not matter


def faults(kind: str, k: int = 1, workers: int = 4, **spec) -> Faults:
    return Faults(FaultSpec(k=k, kind=kind, **spec), workers, seed=7)


def signs_message(bits: list[int]) -> Message:
    return Message({"signs": pack_bits(torch.tensor(bits, dtype=torch.bool))})


def ternary_message(t: list[int]) -> Message:
    """TernGrad's planes: bit 0 is [t = 0], bit 1 is [t = +1]."""
    t = torch.tensor(t)
    return Message({"codes": torch.stack([pack_bits(t == 0), pack_bits(t == 1)])})


def ternary_values(message: Message, n: int) -> list[int]:
    zero, plus = (unpack_bits(p, n) for p in message["codes"])
    return [0 if z else (1 if p else -1) for z, p in zip(zero.tolist(), plus.tolist(), strict=True)]


BITS = [1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 0, 1]


def test_only_the_last_k_workers_are_faulty():
    honest = [signs_message(BITS) for _ in range(4)]
    sent = faults("flip", k=2).corrupt(honest, workers=[0, 1, 2, 3], step=0)
    assert sent[0] is honest[0] and sent[1] is honest[1]
    assert sent[2] is not honest[2] and sent[3] is not honest[3]
    assert faults("flip", k=0).corrupt(honest, workers=[0, 1, 2, 3], step=0) is honest


def test_sign_faults_by_hand():
    honest = signs_message(BITS)
    unpack = lambda m: unpack_bits(m["signs"], N_BITS).int().tolist()  # noqa: E731
    assert unpack(faults("flip").message(honest, 3, step=5)) == [1 - b for b in BITS]
    assert unpack(faults("scaled").message(honest, 3, step=5)) == BITS  # a bit has no magnitude to scale
    # zero (and drop): the pattern an exact-zero update sends, +1 where index + step is even
    for kind in ("zero", "drop"):
        assert unpack(faults(kind).message(honest, 3, step=5)) == [int((i + 5) % 2 == 0) for i in range(N_BITS)]
        assert unpack(faults(kind).message(honest, 3, step=6)) == [int(i % 2 == 0) for i in range(N_BITS)]
    # random: drawn from (seed, step, worker) alone, so every backend draws the same
    big = Message({"signs": torch.zeros(4096, dtype=torch.uint8)})
    a, b = faults("random").message(big, 3, step=2), faults("random").message(big, 3, step=2)
    assert torch.equal(a["signs"], b["signs"])
    assert not torch.equal(a["signs"], faults("random").message(big, 2, step=2)["signs"])
    assert not torch.equal(a["signs"], faults("random").message(big, 3, step=3)["signs"])
    ones = unpack_bits(a["signs"], 8 * 4096).float().mean()
    assert 0.48 < ones < 0.52


def test_signs_with_a_zero_plane_send_a_true_zero():
    nonzero = [1] * N_BITS
    honest = Message({"signs": pack_bits(torch.tensor(BITS, dtype=torch.bool)),
                      "nonzero": pack_bits(torch.tensor(nonzero, dtype=torch.bool))})
    zero = faults("zero").message(honest, 3, step=0)
    assert not unpack_bits(zero["nonzero"], N_BITS).any()
    flipped = faults("flip").message(honest, 3, step=0)
    assert unpack_bits(flipped["signs"], N_BITS).int().tolist() == [1 - b for b in BITS]
    assert torch.equal(flipped["nonzero"], honest["nonzero"])


def test_ternary_faults_by_hand():
    t = [-1, 0, 1, 1, 0, -1, 0, 1, -1, -1, 0, 1, 0]
    honest = ternary_message(t)
    assert ternary_values(faults("flip").message(honest, 3, 0), len(t)) == [-v for v in t]
    assert ternary_values(faults("zero").message(honest, 3, 0), len(t)) == [0] * len(t)
    assert ternary_values(faults("scaled").message(honest, 3, 0), len(t)) == t  # codes are bounded
    random = ternary_values(faults("random").message(honest, 3, 0), len(t))
    assert [v == 0 for v in random] == [v == 0 for v in t]  # signs drawn where the worker sent one


def test_value_faults_by_hand():
    g = torch.tensor([0.5, -2.0, 0.0, 3.0])
    honest = Message({"grad": g})
    assert torch.equal(faults("flip").message(honest, 3, 0)["grad"], -g)
    assert torch.equal(faults("scaled", scale=10.0).message(honest, 3, 0)["grad"], g * 10)
    assert torch.equal(faults("zero").message(honest, 3, 0)["grad"], torch.zeros(4))
    big = Message({"grad": torch.full((20000,), 3.0)})
    noise = faults("random").message(big, 3, 0)["grad"]
    assert abs(noise.square().mean().sqrt().item() - 3.0) < 0.1 and abs(noise.mean().item()) < 0.1
    sparse = Message({"values": torch.tensor([1.0, -1.0]), "indices": torch.tensor([4, 9], dtype=torch.int32),
                      "dense": torch.tensor([2.0])})
    flipped = faults("flip").message(sparse, 3, 0)
    assert flipped["values"].tolist() == [-1.0, 1.0] and flipped["dense"].tolist() == [-2.0]
    assert torch.equal(flipped["indices"], sparse["indices"])
    assert flipped.bits == sparse.bits  # the bits counted are those of the message sent


def test_stale_resends_the_previous_step():
    f = faults("stale")
    sent = [f.message(signs_message([step % 2] * N_BITS), 3, step) for step in range(3)]
    first = lambda m: int(unpack_bits(m["signs"], 1))  # noqa: E731
    assert [first(m) for m in sent] == [0, 0, 1]  # step 0 has nothing older: its own message


def test_unknown_kind_too_many_workers_and_in_backward_are_refused():
    with pytest.raises(ValueError, match=r"cluster.faults.kind='lie' is unknown; choose one of"):
        FaultSpec(k=1, kind="lie")
    with pytest.raises(ValueError, match=r"cluster.faults.k=5 exceeds cluster.workers=4"):
        faults("flip", k=5)
    with pytest.raises(ValueError, match=r"method=dlion_ddp exchanges inside DDP's backward"):
        faults("flip").check("dlion_ddp", "in_backward")
    with pytest.raises(ValueError, match=r"no fault model for a message of \['payload0'\]"):
        faults("flip").message(Message({"payload0": torch.zeros(3)}), 3, 0)


@pytest.mark.parametrize("n, k", [(5, 2), (8, 3), (4, 1)])
def test_a_vote_outlasts_a_flipped_minority_where_a_mean_follows_one_worker(n, k):
    """MaVo's vote with k < N/2 flipped workers is the honest vote where the honest workers agree (Bernstein et
    al. 2019); the mean of G-AdamW's gradients takes its size from a single scaled worker."""
    torch.manual_seed(0)
    numel = 1000
    agreed = torch.rand(numel) < 0.5
    dlion = build_method("dlion", lr=1e-3).bind(torch.zeros(numel), n)
    ctx = StepContext(step=0, lr=1e-3, num_workers=n)
    honest = [Message({"signs": pack_bits(agreed)}) for _ in range(n)]
    sent = faults("flip", k=k, workers=n).corrupt(honest, workers=list(range(n)), step=0)
    vote = dlion.server_rule(sent, ctx)["vote"]
    assert torch.equal(unpack_bits(vote, numel), agreed)

    adamw = build_method("adamw", lr=1e-3).bind(torch.zeros(numel), n)
    grad = torch.where(agreed, 1.0, -1.0)
    sent = faults("scaled", k=1, workers=n).corrupt([Message({"grad": grad.clone()}) for _ in range(n)],
                                                     workers=list(range(n)), step=0)
    mean = adamw.server_rule(sent, ctx)["mean_grad"]
    assert torch.allclose(mean, grad * (n - 1 + 1000) / n)  # one worker of n sets the size of every entry


STEPS = ["train.steps=40", "train.eval_every=40", "cluster.workers=4"]


def test_k_zero_is_bitwise_the_run_without_the_setting(make_cfg, tmp_path):
    cfg = make_cfg("method=dlion", *STEPS)
    without = cfg.copy()
    with open_dict(without):
        del without.cluster["faults"]
    assert config_hash(cfg) == config_hash(without)  # finished runs made before faults keep their hash
    a, b = run(cfg, tmp_path / "k0"), run(without, tmp_path / "none")
    assert a["params_sha256"] == b["params_sha256"]
    flipped = run(make_cfg("method=dlion", *STEPS, "cluster.faults.k=1"), tmp_path / "k1")
    assert flipped["params_sha256"] != a["params_sha256"]
    assert flipped["config_hash"] != a["config_hash"]
    assert flipped["total_bits"] == a["total_bits"]  # a flipped sign costs the same bits


@pytest.mark.parametrize("method", ["dlion", "dgc"])
def test_stale_workers_resume_exactly(make_cfg, tmp_path, crash_after_checkpoint, method):
    """What a stale worker resends next lives in the checkpoint: a resumed run ends where an uninterrupted one
    does (DGC's stale message is sparse, of another size than this step's: its bits are the ones sent)."""
    cfg = make_cfg(f"method={method}", *STEPS, "cluster.faults.k=2", "cluster.faults.kind=stale",
                   "train.checkpoint_every=10")
    reference = run(cfg, tmp_path / "reference")
    crash_after_checkpoint(cfg, tmp_path / "crashed", 20)
    resumed = run(cfg, tmp_path / "crashed")
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert resumed["total_bits"] == reference["total_bits"]
