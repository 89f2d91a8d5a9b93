"""Distributed Lion against the paper's equations, hand-computed cases and timm's Lion."""

from __future__ import annotations

import copy

import pytest
import torch
from timm.optim import Lion
from torch import nn

from distlion import Simulation
from distlion.cluster.grads import sequential_worker_grads
from distlion.cluster.simulated import SimulatedCluster
from distlion.flat import FlatParams
from distlion.methods import StepContext, build_method

X0 = [1.0, -1.0, 0.5, 0.0, 2.0]
# Three workers, five parameters; zeros make worker signs of exactly 0 (ties).
STEP0 = [[1.0, -2.0, 0.0, 3.0, -1.0], [2.0, 1.0, -1.0, -3.0, 0.0], [-1.0, -1.0, 0.0, 2.0, 4.0]]
STEP1 = [[0.0] * 5] * 3


def run_hand_case(aggregation: str) -> list[torch.Tensor]:
    sim = Simulation("dlion", [torch.tensor(X0)], num_workers=3, lr=0.1, weight_decay=0.5, aggregation=aggregation)
    return [sim.step([[torch.tensor(g)] for g in grads]).params[0].clone() for grads in (STEP0, STEP1)]


def test_mavo_hand_computed_with_zero_sign_ties():
    x1, x2 = run_hand_case("mavo")
    # Step 0: signs of 0.1*g; zeros -> +1 at even index (step 0): w0 [+,-,+,+,-], w1 [+,+,-,-,+],
    # w2 [-,-,+,+,+]; sums [1,-1,1,1,1] -> Delta [+,-,+,+,+]; x1 = 0.95*x0 - 0.1*Delta.
    assert torch.allclose(x1, torch.tensor([0.85, -0.85, 0.375, -0.1, 1.8]))
    # Step 1: g = 0, so the sign is that of m = 0.01*g_prev; zeros -> +1 at odd index (step 1):
    # w0 [+,-,-,+,-], w1 [+,+,-,-,-], w2 [-,-,-,+,+]; sums [1,-1,-3,1,-1] -> Delta [+,-,-,+,-].
    expected = x1 * 0.95 - 0.1 * torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0])
    assert torch.allclose(x2, expected)


def test_avg_hand_computed():
    x1, x2 = run_hand_case("avg")
    third = 1.0 / 3.0
    assert torch.allclose(x1, torch.tensor(X0) * 0.95 - 0.1 * torch.tensor([third, -third, third, third, third]))
    expected = x1 * 0.95 - 0.1 * torch.tensor([third, -third, -1.0, third, -third])
    assert torch.allclose(x2, expected)


@pytest.mark.parametrize(
    ("rule", "delta"),
    [("alternate", [1.0, -1.0, 1.0, -1.0]), ("positive", [1.0, 1.0, 1.0, -1.0]), ("negative", [-1.0, -1.0, 1.0, -1.0])],
)
def test_mavo_tie_rules_even_workers(rule, delta):
    sim = Simulation("dlion", [torch.zeros(4)], num_workers=2, lr=1.0, mavo_tie=rule)
    out = sim.step([[torch.tensor([1.0, -1.0, 1.0, -1.0])], [torch.tensor([-1.0, 1.0, 1.0, -1.0])]])
    assert torch.equal(out.params[0], -torch.tensor(delta))


def test_momentum_is_per_worker_and_matches_paper_update():
    torch.manual_seed(0)
    sim = Simulation("dlion", [torch.randn(37)], num_workers=3, lr=0.01, betas=(0.9, 0.99))
    momenta = [torch.zeros(37) for _ in range(3)]
    x = sim.params[0].clone()
    for _ in range(5):
        grads = [torch.randn(37) for _ in range(3)]
        out = sim.step([[g] for g in grads])
        signs = torch.stack([torch.sign(0.9 * m + 0.1 * g) for m, g in zip(momenta, grads)])
        assert (signs != 0).all()
        x = x - 0.01 * torch.sign(signs.sum(0))
        momenta = [0.99 * m + 0.01 * g for m, g in zip(momenta, grads)]
        assert torch.allclose(out.params[0], x, atol=1e-6)
        for state, m in zip(out.worker_states, momenta):
            assert torch.allclose(state["momentum"], m, atol=1e-6)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


def per_example_loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def train(method_name: str, num_workers: int, steps: int, identical: bool = False, **hparams):
    """Our method on N simulated workers, a copy of the model for the reference optimizer, and the
    global batches. With `identical`, every worker gets the same 8 examples."""
    model = small_model()
    reference = copy.deepcopy(model)
    flat = FlatParams(model)
    cluster = SimulatedCluster(build_method(method_name, **hparams), flat, num_workers)
    g = torch.Generator().manual_seed(1)
    rows = 8 if identical else num_workers * 8
    batches = [(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(steps)]
    if identical:
        batches = [(x.repeat(num_workers, 1), y.repeat(num_workers)) for x, y in batches]
    for step, (x, y) in enumerate(batches):
        grads, _ = sequential_worker_grads(model, flat, per_example_loss, x, y, num_workers)
        cluster.step(grads, step=step, lr=hparams["lr"])
    return model, reference, batches


def reference_train(reference: nn.Module, optimizer: torch.optim.Optimizer, batches) -> nn.Module:
    for x, y in batches:
        optimizer.zero_grad()
        per_example_loss(reference, x, y).mean().backward()
        optimizer.step()
    return reference


def assert_same_params(a: nn.Module, b: nn.Module, atol: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=atol, rtol=0), name


def test_dlion_one_worker_equals_timm_lion():
    model, reference, batches = train("dlion", 1, 50, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    optimizer = Lion(reference.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    assert_same_params(model, reference_train(reference, optimizer, batches), atol=1e-6)


@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
def test_dlion_identical_workers_equal_timm_lion(aggregation):
    """Lossless case: workers with identical data send identical signs, so any vote is exact."""
    model, reference, batches = train("dlion", 4, 20, identical=True, lr=1e-3, weight_decay=0.1,
                                      aggregation=aggregation)
    optimizer = Lion(reference.parameters(), lr=1e-3, weight_decay=0.1)
    assert_same_params(model, reference_train(reference, optimizer, batches), atol=1e-6)


def test_global_adamw_equals_torch_adamw_on_global_batch():
    model, reference, batches = train("adamw", 4, 20, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999))
    assert_same_params(model, reference_train(reference, optimizer, batches), atol=1e-5)


def test_global_lion_equals_timm_lion_on_global_batch():
    model, reference, batches = train("lion", 4, 20, lr=1e-3, weight_decay=0.1)
    optimizer = Lion(reference.parameters(), lr=1e-3, weight_decay=0.1)
    assert_same_params(model, reference_train(reference, optimizer, batches), atol=1e-5)


def test_dlion_differs_from_global_lion_with_disagreeing_workers():
    """Guards the tests above: with 4 workers on different data, MaVo is not G-Lion."""
    model, _, _ = train("dlion", 4, 20, lr=1e-3)
    glion, _, _ = train("lion", 4, 20, lr=1e-3)
    assert not all(torch.allclose(p, q, atol=1e-6) for p, q in zip(model.parameters(), glion.parameters()))


def test_one_worker_with_ternary_signs_is_timm_lion_bitwise_where_updates_are_zero():
    """An embedding whose rows no token of the batch touches gets gradient rows of exactly 0: timm's Lion
    leaves them (torch.sign(0) = 0), the 1-bit settings move them by lr, zero_sign="zero" leaves them too."""
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 8)
    reference = nn.Embedding(50, 8)
    reference.load_state_dict(embedding.state_dict())
    optimizer = Lion(reference.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    sims = {rule: Simulation("dlion", [embedding.weight.detach()], 1, lr=1e-2, weight_decay=0.1, zero_sign=rule)
            for rule in ("zero", "alternate")}
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        tokens = torch.randint(0, 20, (16,), generator=g)  # rows 20..49 never used: their gradients stay 0
        target = torch.randn(16, 8, generator=g)
        optimizer.zero_grad()
        (reference(tokens) - target).pow(2).mean().backward()
        grad = reference.weight.grad.clone()
        optimizer.step()
        for sim in sims.values():
            sim.step([[grad]])
    (zero,) = sims["zero"].params
    assert torch.equal(zero, reference.weight.detach())
    (one_bit,) = sims["alternate"].params
    untouched = slice(20, 50)  # weight decay only under Lion; the 1-bit rule moves them by lr each step
    assert not torch.equal(one_bit[untouched], reference.weight.detach()[untouched])


@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
def test_ternary_server_rule_is_the_sum_of_the_workers_signs_including_zeros(aggregation):
    method = build_method("dlion", aggregation=aggregation, zero_sign="zero").bind(torch.zeros(24), 4)
    g = torch.Generator().manual_seed(3)
    updates = [torch.randint(-1, 2, (24,), generator=g).float() for _ in range(4)]  # many exact zeros
    messages = [method.worker_rule(u * 10, {"momentum": torch.zeros(24)}, StepContext(0, 1.0, 4))
                for u in updates]
    assert all(m.bits == 2 * 24 for m in messages)  # two planes up
    down = method.server_rule(messages, StepContext(0, 1.0, 4))
    total = torch.stack([torch.sign(u) for u in updates]).sum(0)
    params = torch.zeros(24)
    method.bind(params, 4)
    method.apply_rule(down, StepContext(0, 1.0, 4))
    expected = -(torch.sign(total) if aggregation == "mavo" else total / 4)
    assert torch.equal(params, expected)
    assert down.bits == (2 * 24 if aggregation == "mavo" else 4 * 24)  # ceil(log2(2 * 4 + 1)) = 4 planes


def test_gradient_clipping_changes_the_signs_after_the_first_step():
    """Clipping rescales g against the momentum in b1 m + (1 - b1) g: not a no-op on a sign method. At the
    first step (m = 0) the signs are g's either way; afterwards the runs part (README: on clipping)."""
    from distlion import DistributedLion

    def run(clip: float | None, steps: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))
        optimizer = DistributedLion(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if clip is not None:
                norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
                assert norm > clip  # it did clip
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(p, q) for p, q in zip(run(None, 1), run(0.01, 1), strict=True))
    free, clipped = torch.cat([p.reshape(-1) for p in run(None, 20)]), torch.cat([p.reshape(-1) for p in run(0.01, 20)])
    assert (free != clipped).float().mean() > 0.05


def test_distributed_lion_steps_persistent_flat_buffers_without_per_step_copies():
    """From the second step on, the parameters and their gradients are views of one flat buffer per param group,
    which the step updates in place: their storage never moves, and backward accumulates straight into it."""
    from distlion import DistributedLion

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    optimizer = DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1)
    lion = Lion(reference.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    places = []
    for _ in range(5):
        x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
        for net, opt in ((model, optimizer), (reference, lion)):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        places.append([(p.data_ptr(), p.grad.data_ptr()) for p in model.parameters()])
    assert places[1:] == [places[1]] * 4  # the same storage at every step after the first
    starts = [p for p, _ in places[1]]
    sizes = [4 * p.numel() for p in model.parameters()]
    assert starts == [starts[0] + sum(sizes[:i]) for i in range(len(sizes))]  # one buffer, back to back
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)  # (timm's sign(0) = 0 aside: no exact zeros here)


def test_zero_grad_then_no_backward_is_no_gradient_and_an_assigned_one_persists():
    """zero_grad keeps the flat buffer's views but marks them as set_to_none would: a parameter no backward
    reached is left alone (no decay, no momentum decay), as timm's Lion leaves a None gradient; a gradient the
    user assigned and never cleared steps again at every call, as in torch."""
    from distlion import DistributedLion

    def pair():
        torch.manual_seed(0)
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        return a, b, [*a.parameters(), *b.parameters()]

    a, b, ours_params = pair()
    c, d, theirs_params = pair()
    ours, theirs = DistributedLion(ours_params, lr=1e-2, weight_decay=0.1), Lion(theirs_params, lr=1e-2,
                                                                                 weight_decay=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    for step in range(4):
        for first, second, opt in ((a, b, ours), (c, d, theirs)):
            opt.zero_grad()
            out = first(x) if step % 2 else second(first(x))  # odd steps: `second` gets no gradient
            out.square().mean().backward()
            opt.step()
        for p, q in zip(ours_params, theirs_params, strict=True):
            assert torch.allclose(p, q, atol=1e-6, rtol=0), step
    before = [p.detach().clone() for p in ours_params]
    ours.step()  # the last backward's gradients are still there: they step again
    ours.step()
    assert all(not torch.equal(p, q) for p, q in zip(ours_params[:2], before[:2], strict=True))


@pytest.mark.parametrize("zero_sign", ["alternate", "positive", "zero"])
@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
def test_the_blocked_worker_rule_and_apply_equal_one_block_bitwise(monkeypatch, zero_sign, aggregation):
    """On CPU the eager rule and MaVo's apply run block by block (for the cache): the same bits and parameters as in
    one block, with exact zeros (ties), a size that is no multiple of the block or of 8, and several steps."""
    import distlion.methods.dlion as dlion_module

    n, workers = 1000 + 5, 3
    torch.manual_seed(0)
    grads = [torch.randn(workers, n) for _ in range(3)]
    for g in grads:
        g[:, ::7] = 0  # ties at every step

    def run(block: int):
        monkeypatch.setattr(dlion_module, "CPU_BLOCK", block)
        method = build_method("dlion", lr=1e-2, weight_decay=0.1, aggregation=aggregation, zero_sign=zero_sign)
        method.fused = False  # the blocks are the eager ops' (the fused kernels: tests/test_kernels.py)
        sim = Simulation(method, [torch.nn.Parameter(torch.linspace(-1, 1, n))], workers)
        results = [sim.step([[g] for g in step]) for step in grads]
        momenta = [state["momentum"].clone() for state in results[-1].worker_states]
        return sim.params[0].clone(), momenta, [(r.bits_up, r.bits_down) for r in results]

    blocked, whole = run(64), run(1 << 30)
    assert torch.equal(blocked[0], whole[0])
    assert all(torch.equal(a, b) for a, b in zip(blocked[1], whole[1], strict=True))
    assert blocked[2] == whole[2]
