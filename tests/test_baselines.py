"""The compression baselines (DGC, TernGrad, GradDrop): hand-computed steps, parity with the base
optimizer when compression is off, bit counts pinned to the issue's formulas, and bad settings.

Steps run through the runner's own loop (`algorithm1_step`) on a simulated backend that records
the messages."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from omegaconf import OmegaConf

from distlion.cluster.simulated import SimulatedBackend
from distlion.comm.message import Message
from distlion.comm.packing import unpack_uint
from distlion.flat import Segment
from distlion.methods import build_method
from distlion.methods.base import Method, StepContext
from distlion.methods.dgc import DGC, sampled_topk
from distlion.methods.graddrop import GradDrop, exact_topk
from distlion.methods.step import BufferWorkers, algorithm1_step
from distlion.methods.terngrad import TernGrad

# 10 parameters: a 2x4 weight matrix and a bias of 2 (DGC sparsifies only the matrix).
MATRIX_AND_BIAS = [Segment("w", 0, 8, (2, 4)), Segment("b", 8, 2, (2,))]
# 10 parameters: a 2x3 matrix and a vector of 4.
TWO_LAYERS = [Segment("a", 0, 6, (2, 3)), Segment("b", 6, 4, (4,))]


@dataclasses.dataclass
class Exchange:
    up: list[Message]
    down: Message
    pre_up: list[Message]
    pre_down: Message


class RecordingBackend(SimulatedBackend):
    """The simulated backend, keeping every exchange's uplinks and downlink for the test to read."""

    def __init__(self, num_workers: int):
        super().__init__(num_workers)
        self.exchanges: list[tuple[list[Message], Message]] = []

    def exchange(self, how, server_rule, messages):
        reply, bits = super().exchange(how, server_rule, messages)
        self.exchanges.append((messages, reply))
        return reply, bits


def drive(method: Method, grads, states, step=0, lr=1.0, epoch=0.0, seed=0) -> Exchange:
    """One step of the runner's Algorithm 1 loop: (pre-exchange), worker rules, server rule, apply rule."""
    backend = RecordingBackend(len(grads))
    ctx = StepContext(step=step, lr=lr, num_workers=len(grads), epoch=epoch, seed=seed)
    local = BufferWorkers([method] * len(grads), states)
    algorithm1_step({torch.float32: local}, {torch.float32: torch.stack(grads)}, ctx, backend)
    *pre, (up, down) = backend.exchanges
    pre_up, pre_down = pre[0] if pre else ([], Message())
    return Exchange(up, down, pre_up, pre_down)


def bound(method: Method, numel: int, num_workers: int, layout=None, params=None):
    x = torch.zeros(numel) if params is None else params
    method.bind(x, num_workers, layout)
    return x, [method.init_worker_state() for _ in range(num_workers)]


def sparse(message: Message) -> dict[int, float]:
    """A sparse message as {index: value}."""
    return dict(zip(message["indices"].tolist(), message["values"].tolist(), strict=True))


def t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def reference_run(
    make_optimizer, x0: torch.Tensor, grads: list[torch.Tensor], lrs: list[float]
) -> torch.Tensor:
    """The base optimizer stepped on the all-reduced mean gradient."""
    p = torch.nn.Parameter(x0.clone())
    opt = make_optimizer([p])
    for g, lr in zip(grads, lrs, strict=True):
        for group in opt.param_groups:
            group["lr"] = lr
        p.grad = g.mean(dim=0)
        opt.step()
    return p.detach()


# ---------------------------------------------------------------------------------------------- DGC


def test_dgc_hand_computed_two_workers_with_masking_and_carry_over():
    """m = 0.5, sparsity 0.75 (top-2 of the 8 matrix entries), exact top-k, no clipping/warm-up."""
    method = DGC(lr=0.01, momentum=0.5, sparsity=0.75, clip_norm=None, warmup_epochs=0, exact_topk=True)
    x, states = bound(method, 10, 2, MATRIX_AND_BIAS)

    # Step 0: u = v = g. Worker 0 sends |4|, |-3| (indices 0, 6); worker 1 sends |-4|, |3| (2, 0).
    g0 = t(4, -1, 0.5, 2, 0, 0, -3, 1, 1, 2)
    g1 = t(3, 2, -4, 0, 0.5, 0, 0, 1, 3, -2)
    ex = drive(method, [g0, g1], states, step=0, lr=1.0)
    assert sparse(ex.up[0]) == {0: 4, 6: -3} and ex.up[0]["dense"].tolist() == [1, 2]
    assert sparse(ex.up[1]) == {0: 3, 2: -4} and ex.up[1]["dense"].tolist() == [3, -2]
    assert [m.bits for m in ex.up] == [2 * 64 + 2 * 32] * 2
    # Union {0, 2, 6}: 2 * 3 < 8 matrix entries, so the downlink is sparse: 3 * 64 + 2 * 32 bits.
    assert sparse(ex.down) == {0: 3.5, 2: -2, 6: -1.5} and ex.down["dense"].tolist() == [2, 0]
    assert ex.down.bits == 256
    assert x.tolist() == [-3.5, 0, 2, 0, 0, 0, 1.5, 0, -2, 0]
    # Sent entries leave v; masking also clears u there; the bias keeps its momentum.
    assert states[0]["velocity"][:8].tolist() == [0, -1, 0.5, 2, 0, 0, 0, 1]
    assert states[0]["momentum"].tolist() == [0, -1, 0.5, 2, 0, 0, 0, 1, 1, 2]

    # Step 1: worker 0's index 3 carries 2 into v = 2 + (0.5 * 2 + 1) = 4 and is sent; masked u[0] = 0
    # gives u[0] = 1 (not 0.5 * 4 + 1).
    g0 = t(1, 1, 1, 1, 1, 1, 1, 1, 0, 2)
    g1 = t(-1, 0, 0, 0, 2, 0, 0, 0, 1, 0)
    ex = drive(method, [g0, g1], states, step=1, lr=1.0)
    assert sparse(ex.up[0]) == {3: 4, 7: 2.5} and ex.up[0]["dense"].tolist() == [0.5, 3]
    assert sparse(ex.up[1]) == {1: 3, 4: 2.75} and ex.up[1]["dense"].tolist() == [2.5, -1]
    assert states[0]["momentum"].tolist() == [1, 0.5, 1.25, 0, 1, 1, 1, 0, 0.5, 3]
    assert states[0]["velocity"][:8].tolist() == [1, -0.5, 1.75, 0, 1, 1, 1, 0]
    assert states[1]["velocity"][:8].tolist() == [-1, 0, 0, 0, 0, 0, 0, 1.5]
    # Union {1, 3, 4, 7}: 2 * 4 is not < 8, so the whole mean goes down dense: 32 * 10 bits.
    assert ex.down["mean_grad"].tolist() == [0, 1.5, 0, 2, 1.375, 0, 0, 1.25, 1.5, 1]
    assert ex.down.bits == 320
    assert x.tolist() == [-3.5, -1.5, 2, -2, -1.375, 0, 1.5, -1.25, -3.5, -1]


def test_dgc_local_clipping_scales_the_global_threshold_before_accumulation():
    """Worker i's share g_i / N is clipped at N^(-1/2) clip_norm, i.e. ||g_i|| at sqrt(N) clip_norm."""
    method = DGC(
        momentum=0.5, sparsity=0.0, clip_norm=5 / math.sqrt(2), momentum_masking=False, warmup_epochs=0
    )
    _, states = bound(method, 10, 2)
    g0 = t(6, 8, 0, 0, 0, 0, 0, 0, 0, 0)  # norm 10 > 5: halved
    g1 = t(0, 0, 3, 4, 0, 0, 0, 0, 0, 0)  # norm 5: kept (clipping at 5 / sqrt(2) would shrink it)
    ex = drive(method, [g0, g1], states, step=0)
    assert sparse(ex.up[0]) == pytest.approx({0: 3, 1: 4})
    torch.testing.assert_close(states[1]["momentum"], g1)
    # u = 0.5 * u + clip(g): the gradient is clipped, not the accumulated u (norm 7.5 > 5 stays).
    drive(method, [g0, g1], states, step=1)
    torch.testing.assert_close(states[0]["momentum"], 1.5 * g0 / 2)
    torch.testing.assert_close(states[1]["momentum"], 1.5 * g1)


def test_dgc_warmup_schedule_and_its_use_in_the_worker_rule():
    method = DGC()
    epochs = [0, 0.5, 1, 2, 3, 4, 5, 50]
    expected = [0.75, 0.75, 0.9375, 0.984375, 0.99609375, 0.999, 0.999, 0.999]
    assert [method.sparsity_at(e) for e in epochs] == pytest.approx(expected, abs=1e-12)
    assert DGC(warmup_epochs=0).sparsity_at(0) == 0.999
    assert DGC(sparsity=0.9).sparsity_at(3) == pytest.approx(0.9)  # warm-up never exceeds the target

    method = DGC(exact_topk=True, clip_norm=None)
    _, states = bound(method, 1000, 1, [Segment("w", 0, 1000, (10, 100))])
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    ex = drive(method, [grad], states, epoch=1.5)
    assert ex.up[0]["indices"].numel() == math.ceil(1000 * 0.0625)


def test_dgc_sampled_threshold_keeps_the_count_near_k():
    importance = torch.randn(100_000, generator=torch.Generator().manual_seed(1)).abs()
    for keep in (0.01, 0.001):
        k = math.ceil(100_000 * keep)
        counts = []
        for seed in range(20):
            idx = sampled_topk(importance, keep, torch.Generator().manual_seed(seed))
            counts.append(idx.numel())
            chosen = torch.zeros_like(importance, dtype=torch.bool)
            chosen[idx] = True
            assert importance[chosen].min() >= importance[~chosen].max()  # a threshold set
        assert all(0.8 * k <= c <= 1.3 * k for c in counts), (keep, k, counts)
        assert any(c != k for c in counts)  # the threshold really is estimated


def test_dgc_compression_off_equals_sgd_with_momentum_on_the_mean_gradient():
    layout = [Segment("w1", 0, 20, (4, 5)), Segment("b1", 20, 5, (5,)), Segment("w2", 25, 12, (3, 4))]
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(37, generator=gen)
    grads = [torch.randn(3, 37, generator=gen) for _ in range(6)]
    lrs = [0.1 / (1 + s) for s in range(6)]  # a schedule: ctx.lr must be used
    method = DGC(
        lr=123.0,
        momentum=0.9,
        weight_decay=0.05,
        sparsity=0.0,
        clip_norm=None,
        momentum_masking=False,
        warmup_epochs=0,
    )
    x, states = bound(method, 37, 3, layout, params=x0.clone())
    for step, (g, lr) in enumerate(zip(grads, lrs, strict=True)):
        ex = drive(method, list(g), states, step=step, lr=lr)
        assert [m.bits for m in ex.up] == [64 * 32 + 32 * 5] * 3  # every matrix entry sent, bias dense
    expected = reference_run(
        lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9, weight_decay=0.05), x0, grads, lrs
    )
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)


def test_dgc_bits_follow_the_payload_and_the_smaller_downlink():
    layout = [Segment("w", 0, 900, (30, 30)), Segment("b", 900, 100, (100,))]
    method = DGC(sparsity=0.99, clip_norm=None, warmup_epochs=0)
    _, states = bound(method, 1000, 4, layout)
    grads = list(torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)))
    ex = drive(method, grads, states)
    union = set()
    for m in ex.up:
        assert m.bits == 64 * m["indices"].numel() + 32 * 100
        union |= set(m["indices"].tolist())
    assert 2 * len(union) < 900 and ex.down.bits == 64 * len(union) + 32 * 100
    # A bare flat buffer has no matrix: it is sparsified whole.
    method = DGC(sparsity=0.9, clip_norm=None, warmup_epochs=0, exact_topk=True)
    _, states = bound(method, 1000, 1)
    ex = drive(method, grads[:1], states)
    assert ex.up[0].bits == 64 * 100


def test_dgc_state_dict_round_trip_continues_identically():
    def make():
        return DGC(
            momentum=0.9, weight_decay=0.1, sparsity=0.5, clip_norm=None, warmup_epochs=0, exact_topk=True
        )

    gen = torch.Generator().manual_seed(4)
    grads = [list(torch.randn(2, 10, generator=gen)) for _ in range(4)]
    a = make()
    xa, states = bound(a, 10, 2, MATRIX_AND_BIAS, params=torch.ones(10))
    for step in range(2):
        drive(a, grads[step], states, step=step, lr=0.1)
    b = make()
    xb, _ = bound(b, 10, 2, MATRIX_AND_BIAS, params=xa.clone())
    b.load_state_dict(a.state_dict())
    states_b = [{k: v.clone() for k, v in s.items()} for s in states]
    for step in range(2, 4):
        drive(a, grads[step], states, step=step, lr=0.1)
        drive(b, grads[step], states_b, step=step, lr=0.1)
    assert torch.equal(xa, xb)


# ----------------------------------------------------------------------------------------- TernGrad


def test_terngrad_hand_computed_two_workers_with_shared_scalers():
    """Every |g| is 0 or the shared scaler, so the Bernoulli draws are certain."""
    method = TernGrad(lr=0.01, clip=None, momentum=0.5)
    x, states = bound(method, 10, 2, TWO_LAYERS)

    g0 = t(2, -2, 0, 2, 0, -2, 3, 0, 0, -3)
    g1 = t(0, 2, 2, -2, 0, 0, -3, 3, 0, 0)
    ex = drive(method, [g0, g1], states, step=0, lr=1.0)
    assert [m["scalers"].tolist() for m in ex.pre_up] == [[2, 3], [2, 3]]
    assert ex.pre_down["scalers"].tolist() == [2, 3]
    # Server sums of t_i + 1 (in [0, 2N]): sum_i t_i = [1, 0, 1, 0, 0, -1 | 0, 1, 0, -1].
    assert unpack_uint(ex.down["sums"], 10).tolist() == [3, 2, 3, 2, 2, 1, 2, 3, 2, 1]
    # Delta = S * sum / N; SGD momentum buffer = Delta; x = -Delta.
    assert x.tolist() == [-1, 0, -1, 0, 0, 1, 0, -1.5, 0, 1.5]
    assert [m.bits for m in ex.pre_up] == [2 * 32] * 2 and ex.pre_down.bits == 2 * 32
    assert [m.bits for m in ex.up] == [2 * 16] * 2  # 2 bit-planes of 2 bytes
    assert ex.down.bits == 3 * 16  # ceil(log2(2N + 1)) = 3 bit-planes

    # Step 1: the shared scaler is the max over workers (4 for layer a, 1 for layer b), and the
    # momentum buffer carries over: buf = 0.5 * buf + Delta.
    g0 = t(4, 0, 0, -4, 0, 0, 0, 0, 0, 0)
    g1 = t(0, 0, 0, 0, 0, 0, 0, 0, 1, -1)
    ex = drive(method, [g0, g1], states, step=1, lr=1.0)
    assert [m["scalers"].tolist() for m in ex.pre_up] == [[4, 0], [0, 1]]
    assert ex.pre_down["scalers"].tolist() == [4, 1]
    assert x.tolist() == [-3.5, 0, -1.5, 2, 0, 1.5, 0, -2.25, -0.5, 2.75]


def test_terngrad_clips_each_layer_at_c_times_its_std():
    layout = [Segment("a", 0, 4, (4,)), Segment("b", 4, 4, (4,))]
    grad = t(3, -1, -1, -1, 1, -1, 1, -1)  # std(a) = sqrt(3): 3 -> sqrt(3); std(b) = 1: unchanged
    for clip, expected in ((1.0, [math.sqrt(3), 1.0]), (None, [3.0, 1.0])):
        method = TernGrad(clip=clip)
        _, states = bound(method, 8, 1, layout)
        scalers = method.pre_worker_rule(grad, states[0], StepContext(step=0, lr=1.0, num_workers=1))
        assert scalers["scalers"].tolist() == pytest.approx(expected)


def test_terngrad_is_unbiased_with_a_shared_scaler():
    """E[Delta] = mean_i g_i with S = max_i s_i, checked per element over 300 seeds."""
    layout = [Segment("w", 0, 500, (20, 25)), Segment("b", 500, 500, (500,))]
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(1000, generator=gen), 0.1 * torch.randn(1000, generator=gen)]  # scales differ
    method = TernGrad(clip=None)
    _, states = bound(method, 1000, 2, layout)
    num_seeds = 300
    total = torch.zeros(1000, dtype=torch.float64)
    for seed in range(num_seeds):
        ex = drive(method, grads, states, seed=seed)
        assert int(unpack_uint(ex.down["sums"], 1000).max()) <= 4  # sum_i t_i + N in [0, 2N]
        total += method.decode(ex.down, StepContext(step=0, lr=1.0, num_workers=2)).double()
    scaler = ex.pre_down["scalers"].double().repeat_interleave(torch.tensor([500, 500]))
    # Var(Delta) = sum_i S^2 p_i (1 - p_i) / N^2, p_i = |g_i| / S.
    var = sum(scaler**2 * (g.double().abs() / scaler) * (1 - g.double().abs() / scaler) for g in grads) / 4
    expected = (grads[0] + grads[1]).double() / 2
    mean = total / num_seeds
    random = var > 0
    assert torch.allclose(mean[~random], expected[~random])
    z = (mean - expected)[random] / (var[random] / num_seeds).sqrt()
    assert z.abs().max() < 5.5
    assert 0.8 < (z**2).mean() < 1.2  # right spread too: a Bernoulli(|g| / S) per element


def test_terngrad_randomness_is_seeded_by_seed_step_and_worker():
    ctx = StepContext(step=3, lr=1.0, num_workers=2, worker=1, seed=7)
    draw = torch.rand(8, generator=ctx.generator())
    assert torch.equal(draw, torch.rand(8, generator=ctx.generator()))
    for other in ({"worker": 0}, {"step": 4}, {"seed": 8}):
        assert not torch.equal(
            draw, torch.rand(8, generator=dataclasses.replace(ctx, **other).generator())
        )


def test_terngrad_needs_the_scaler_exchange_of_the_same_step():
    method = TernGrad()
    _, states = bound(method, 10, 2, TWO_LAYERS)
    grads = [torch.ones(10), torch.ones(10)]
    ctx = StepContext(step=0, lr=1.0, num_workers=2)
    with pytest.raises(RuntimeError, match="pre-exchange"):
        method.worker_rule(grads[0], states[0], ctx)
    # The pre-exchange by hand: each worker's scalers, their max, taken in by the worker.
    up = [method.pre_worker_rule(g, s, dataclasses.replace(ctx, worker=i))
          for i, (g, s) in enumerate(zip(grads, states, strict=True))]
    down = method.pre_server_rule(up, ctx)
    method.pre_apply_rule(down, ctx)
    assert [m.bits for m in up] == [64, 64] and down.bits == 64
    method.worker_rule(grads[0], states[0], ctx)
    with pytest.raises(RuntimeError, match="step 1"):
        method.worker_rule(grads[0], states[0], dataclasses.replace(ctx, step=1))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_terngrad_without_ternarization_equals_the_base_optimizer(optimizer):
    gen = torch.Generator().manual_seed(6)
    x0 = torch.randn(10, generator=gen)
    grads = [torch.randn(3, 10, generator=gen) for _ in range(5)]
    lrs = [0.05, 0.04, 0.03, 0.02, 0.01]
    method = TernGrad(lr=9.0, weight_decay=0.1, clip=None, ternarize=False, optimizer=optimizer, momentum=0.8)
    x, states = bound(method, 10, 3, TWO_LAYERS, params=x0.clone())
    for step, (g, lr) in enumerate(zip(grads, lrs, strict=True)):
        ex = drive(method, list(g), states, step=step, lr=lr)
        assert [m.bits for m in ex.up] == [320] * 3 and ex.down.bits == 320
        assert ex.pre_down.bits == 0 and all(m.bits == 0 for m in ex.pre_up)
    if optimizer == "sgd":
        reference = lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.8, weight_decay=0.1)  # noqa: E731
    else:
        reference = lambda p: torch.optim.AdamW(p, lr=1.0, betas=(0.9, 0.999), weight_decay=0.1)  # noqa: E731
    torch.testing.assert_close(x, reference_run(reference, x0, grads, lrs), rtol=1e-5, atol=1e-6)


def test_terngrad_sums_of_many_workers_take_more_than_eight_bit_planes():
    """N = 130: sums + N reach 260, 9 bit-planes; equal gradients of magnitude S decode to themselves."""
    method = TernGrad(clip=None)
    _, states = bound(method, 10, 130, TWO_LAYERS)
    grad = t(2, -2, 0, 2, 0, -2, 3, 0, 0, -3)
    ex = drive(method, [grad] * 130, states)
    assert ex.down["sums"].shape[0] == 9
    assert torch.equal(method.decode(ex.down, StepContext(step=0, lr=1.0, num_workers=130)), grad)


@pytest.mark.parametrize("numel", [1000, 1001])
def test_terngrad_bits_are_two_per_element_up_and_log2_2n_plus_1_down(numel):
    layout = [
        Segment("a", 0, 400, (20, 20)),
        Segment("b", 400, 350, (350,)),
        Segment("c", 750, numel - 750, (numel - 750,)),
    ]
    num_workers, num_layers = 8, 3
    method = TernGrad()
    _, states = bound(method, numel, num_workers, layout)
    ex = drive(method, list(torch.randn(num_workers, numel)), states)
    padded = 8 * math.ceil(numel / 8)  # each bit-plane is padded to whole bytes
    for pre, up in zip(ex.pre_up, ex.up, strict=True):
        assert pre.bits + up.bits == 2 * padded + 32 * num_layers
    width = math.ceil(math.log2(2 * num_workers + 1))
    assert ex.pre_down.bits + ex.down.bits == width * padded + 32 * num_layers


# ----------------------------------------------------------------------------------------- GradDrop


def test_graddrop_hand_computed_two_workers_with_residual_carry_over():
    """drop_ratio 0.8, one global threshold: each worker sends its top 2 of 10; plain SGD, lr 1."""
    method = GradDrop(drop_ratio=0.8, optimizer="sgd", momentum=0.0)
    x, states = bound(method, 10, 2, TWO_LAYERS)

    g0 = t(5, -1, 0, 2, 0, 0, 0, -4, 1.5, 0)
    g1 = t(0, 3, 0, 0, -1, 0, 0, 0, 2, -6)
    ex = drive(method, [g0, g1], states, step=0, lr=1.0)
    assert sparse(ex.up[0]) == {0: 5, 7: -4} and sparse(ex.up[1]) == {1: 3, 9: -6}
    assert states[0]["residual"].tolist() == [0, -1, 0, 2, 0, 0, 0, 0, 1.5, 0]
    assert states[1]["residual"].tolist() == [0, 0, 0, 0, -1, 0, 0, 0, 2, 0]
    assert [m.bits for m in ex.up] == [128, 128]
    assert sparse(ex.down) == {0: 2.5, 1: 1.5, 7: -2, 9: -3} and ex.down.bits == 4 * 64
    assert x.tolist() == [-2.5, -1.5, 0, 0, 0, 0, 0, 2, 0, 3]

    # Step 1: the residuals push index 3 (2 + 1) and 8 (1.5; 2) out; index 4 reaches -1.5.
    g0 = t(0, 0, 0, 1, 0, 0, 0, 0, 0, 0)
    g1 = t(1, 0, 0, 0, -0.5, 0, 0, 0, 0, 0)
    ex = drive(method, [g0, g1], states, step=1, lr=1.0)
    assert sparse(ex.up[0]) == {3: 3, 8: 1.5} and sparse(ex.up[1]) == {4: -1.5, 8: 2}
    assert states[0]["residual"].tolist() == [0, -1, 0, 0, 0, 0, 0, 0, 0, 0]
    assert states[1]["residual"].tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert sparse(ex.down) == {3: 1.5, 4: -0.75, 8: 1.75}
    assert x.tolist() == [-2.5, -1.5, 0, -1.5, 0.75, 0, 0, 2, -1.75, 3]

    # A threshold per layer keeps ceil(0.2 * 6) = 2 of layer a and ceil(0.2 * 4) = 1 of layer b.
    method = GradDrop(drop_ratio=0.8, threshold="layer")
    _, states = bound(method, 10, 1, TWO_LAYERS)
    ex = drive(method, [t(5, -1, 0, 2, 0, 0, 0, -4, 1.5, 0)], states)
    assert sparse(ex.up[0]) == {0: 5, 3: 2, 7: -4}


def test_exact_topk_prefilter_gives_the_exact_top_k():
    importance = torch.rand(200_000, generator=torch.Generator().manual_seed(10))
    # k = 2000 samples every 100th entry; here all of them are 4 or 5, so only the 1000 fives pass
    # the sampled threshold: fewer than k candidates, and the full top-k is taken.
    skewed = importance.clone()
    skewed[::200], skewed[100::200] = 5.0, 4.0
    for values, k in ((importance, 50), (importance, 2000), (importance, 30_000), (skewed, 2000)):
        expected = set(values.topk(k).indices.tolist())
        assert set(exact_topk(values, k).tolist()) == expected
    assert sorted(exact_topk(torch.tensor([0.0, 2.0, 0.0, 1.0]), 3).tolist()) == [1, 3]  # zeros are not sent


@pytest.mark.parametrize("threshold", ["global", "layer"])
def test_graddrop_error_feedback_is_exact(threshold):
    """r_old + g == sent + r_new, bit for bit."""
    method = GradDrop(drop_ratio=0.9, threshold=threshold)
    _, states = bound(method, 10, 1, TWO_LAYERS)
    gen = torch.Generator().manual_seed(7)
    for step in range(5):
        grad = torch.randn(10, generator=gen)
        expected = states[0]["residual"] + grad
        ex = drive(method, [grad], states, step=step)
        sent = torch.zeros(10)
        sent[ex.up[0]["indices"].long()] = ex.up[0]["values"]
        assert torch.equal(sent + states[0]["residual"], expected)
        assert torch.all(sent * states[0]["residual"] == 0)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_graddrop_without_dropping_equals_the_base_optimizer(optimizer):
    gen = torch.Generator().manual_seed(8)
    x0 = torch.randn(10, generator=gen)
    grads = [torch.randn(3, 10, generator=gen) for _ in range(5)]
    lrs = [0.05, 0.04, 0.03, 0.02, 0.01]
    method = GradDrop(lr=9.0, weight_decay=0.1, drop_ratio=0.0, optimizer=optimizer, momentum=0.8)
    x, states = bound(method, 10, 3, TWO_LAYERS, params=x0.clone())
    for step, (g, lr) in enumerate(zip(grads, lrs, strict=True)):
        drive(method, list(g), states, step=step, lr=lr)
    if optimizer == "sgd":
        reference = lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.8, weight_decay=0.1)  # noqa: E731
    else:
        reference = lambda p: torch.optim.AdamW(p, lr=1.0, betas=(0.9, 0.999), weight_decay=0.1)  # noqa: E731
    torch.testing.assert_close(x, reference_run(reference, x0, grads, lrs), rtol=1e-5, atol=1e-6)


def test_graddrop_bits_are_64_per_sent_entry_and_the_smaller_downlink():
    layout = [Segment("a", 0, 150, (10, 15)), Segment("b", 150, 850, (850,))]
    grads = list(torch.randn(4, 1000, generator=torch.Generator().manual_seed(9)))
    for threshold, kept in (("global", 10), ("layer", 2 + 9)):
        method = GradDrop(drop_ratio=0.99, threshold=threshold)
        _, states = bound(method, 1000, 4, layout)
        ex = drive(method, grads, states)
        assert [m.bits for m in ex.up] == [64 * kept] * 4
        union = set().union(*(m["indices"].tolist() for m in ex.up))
        assert ex.down.bits == 64 * len(union)
    method = GradDrop(drop_ratio=0.0)
    _, states = bound(method, 1000, 4, layout)
    assert drive(method, grads, states).down.bits == 32 * 1000  # union = everything: dense is smaller


# ------------------------------------------------------------------------------- settings and configs


@pytest.mark.parametrize(
    "make, setting",
    [
        (lambda: DGC(sparsity=1.0), "sparsity"),
        (lambda: DGC(sparsity=-0.1), "sparsity"),
        (lambda: DGC(clip_norm=0.0), "clip_norm"),
        (lambda: DGC(momentum=1.0), "momentum"),
        (lambda: DGC(warmup_epochs=-1), "warmup_epochs"),
        (lambda: DGC(warmup_coeff=1.0), "warmup_coeff"),
        (lambda: DGC(warmup_epochs=5).check_run(4), "warmup_epochs"),
        (lambda: TernGrad(clip=0.0), "clip"),
        (lambda: TernGrad(clip=-2.5), "clip"),
        (lambda: TernGrad(optimizer="adam"), "optimizer"),
        (lambda: GradDrop(drop_ratio=1.0), "drop_ratio"),
        (lambda: GradDrop(threshold="tensor"), "threshold"),
        (lambda: GradDrop(optimizer="lamb"), "optimizer"),
    ],
)
def test_bad_settings_fail_with_one_line_naming_the_setting(make, setting):
    with pytest.raises(ValueError) as err:
        make()
    message = str(err.value)
    assert message.startswith(f"method.{setting}=") and "\n" not in message


def test_a_warmup_that_fits_the_run_passes_and_one_past_it_is_refused():
    """The boundary: a warm-up of exactly the run's length passes (its sparsity ramps up, then holds); a hair
    longer is refused; no warm-up fits any run."""
    dgc = DGC(warmup_epochs=5)
    dgc.check_run(5)
    assert dgc.sparsity_at(0.0) < dgc.sparsity == dgc.sparsity_at(5.0)
    with pytest.raises(ValueError, match=r"method.warmup_epochs=5 is longer than the run \(4.99 epochs\)"):
        dgc.check_run(4.99)
    DGC(warmup_epochs=0).check_run(0.5)
    assert DGC(warmup_epochs=0).sparsity_at(0.0) == DGC().sparsity


@pytest.mark.parametrize("cls", [DGC, TernGrad, GradDrop])
def test_config_files_build_the_method_with_its_documented_defaults(cls, make_cfg):
    # `~tuned` drops the per-task tuning (conf/tuned/), leaving the method file's own defaults.
    cfg = OmegaConf.to_container(make_cfg(f"method={cls.name}", "~tuned").method)
    name = cfg.pop("name")
    method = build_method(name, **cfg)
    assert isinstance(method, cls)
    assert method.hparams() == cls().hparams()


@pytest.mark.parametrize("name", ["dgc", "terngrad", "graddrop"])
def test_the_simulated_cluster_runs_each_baseline(name):
    from distlion.cluster.simulated import SimulatedCluster
    from distlion.flat import FlatParams

    flat = FlatParams(torch.nn.Linear(8, 4))
    before = flat.buffers[torch.float32].clone()
    cluster = SimulatedCluster(build_method(name, lr=0.1), flat, num_workers=3)
    grads = {torch.float32: torch.randn(3, flat.numel, generator=torch.Generator().manual_seed(11))}
    for step in range(2):
        bits = cluster.step(grads, step=step, lr=0.1)
        assert bits.down > 0 and all(b > 0 for b in bits.up)
    assert not torch.equal(before, flat.buffers[torch.float32])
