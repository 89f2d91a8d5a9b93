"""`DistributedLion` at lr 0, as users' jobs reach it: a warm-up from 0 (transformers' schedulers, the Hugging Face
`Trainer`), a schedule that ends at 0 mid-run, a param group at 0. Such a step moves nothing and updates the momenta,
as timm's Lion (the reference, in a world of one process) and torch's optimizers do; a negative lr is refused."""

from __future__ import annotations

import pytest
import torch
from timm.optim import Lion
from torch import nn
from transformers import get_linear_schedule_with_warmup

from distlion import DistributedLion
from distlion.methods import build_method

ATOL = 1e-6  # the existing timm-Lion comparisons' tolerance (the fused CPU kernels round as one add, timm in two)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


def backward(model: nn.Module, gen: torch.Generator) -> None:
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    nn.functional.cross_entropy(model(x), y).backward()


def run(model: nn.Module, optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler,
        steps: int) -> list[list[torch.Tensor]]:
    """`steps` steps on seeded batches: the lrs used and the parameters after each step."""
    gen, after = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        optimizer.zero_grad()
        backward(model, gen)
        optimizer.step()
        schedule.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def assert_close(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for p, q in zip(ours, theirs, strict=True):
        assert torch.allclose(p.float(), q.float(), atol=ATOL, rtol=0)


def warmup_from_0(optimizer: torch.optim.Optimizer, total: int = 10) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' linear warm-up from 0 over 3 steps, then down to 0 at `total` (and 0 after)."""
    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=total)


def test_a_warm_up_from_0_equals_timm_lion_under_the_same_transformers_scheduler():
    """Its first step (lr 0) used to raise "method.lr=0.0 must be > 0"; now it moves nothing, and the run is Lion."""
    model, reference = small_model(), small_model()
    initial = [p.detach().clone() for p in model.parameters()]
    ours = DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1)
    theirs = Lion(reference.parameters(), lr=1e-2, weight_decay=0.1)
    schedules = [warmup_from_0(ours), warmup_from_0(theirs)]
    assert ours.param_groups[0]["lr"] == 0.0
    mine, timm = run(model, ours, schedules[0], 6), run(reference, theirs, schedules[1], 6)
    assert all(torch.equal(p, q) for p, q in zip(mine[0], initial, strict=True))  # lr 0: nothing moved
    assert all(ours.state[p]["step"] == 6 for p in model.parameters())  # but the step happened (momenta)
    for a, b in zip(mine, timm, strict=True):
        assert_close(a, b)
    assert not torch.allclose(mine[-1][0], initial[0])


def test_lr_0_at_construction_and_in_a_param_group_moves_nothing_and_keeps_the_momenta():
    """The steps at lr 0 still update the momenta, as timm's Lion does: the first step at an lr > 0 shows it."""
    model, reference = small_model(), small_model()
    initial = [p.detach().clone() for p in model.parameters()]
    head = list(model[3].parameters())
    groups = lambda m: [{"params": [*m[0].parameters(), *m[2].parameters()]},  # noqa: E731
                        {"params": [*m[3].parameters()], "lr": 0.0}]
    ours, theirs = DistributedLion(groups(model), lr=0.0), Lion(groups(reference), lr=0.0)
    for step in range(4):
        if step == 2:  # the first group leaves 0; the second stays there
            ours.param_groups[0]["lr"] = theirs.param_groups[0]["lr"] = 1e-2
        for m, optimizer in ((model, ours), (reference, theirs)):
            optimizer.zero_grad()
            backward(m, torch.Generator().manual_seed(step))
            optimizer.step()
        if step < 2:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(head, initial[-2:], strict=True))
    assert_close(list(model.parameters()), list(reference.parameters()))
    assert not torch.allclose(model[0].weight, initial[0])


def test_a_schedule_reaching_0_mid_run_with_bf16_master_weights_equals_timm_lion():
    """bf16 parameters on fp32 masters take the copying step, which built a rule from the lr and raised at 0."""
    model, reference = small_model(), small_model()
    model.to(torch.bfloat16)
    reference.to(torch.bfloat16).float()  # the fp32 reference starts from the same (bf16-rounded) weights
    ours = DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
    theirs = Lion(reference.parameters(), lr=1e-2, weight_decay=0.1)
    schedules = [warmup_from_0(o, total=6) for o in (ours, theirs)]
    gen = torch.Generator().manual_seed(3)
    for step in range(9):  # the lr is 0 at steps 0 and 6..8
        grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
        for p, q, g in zip(model.parameters(), reference.parameters(), grads, strict=True):
            p.grad, q.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
        ours.step()
        theirs.step()
        for schedule in schedules:
            schedule.step()
        if step == 5:
            at_0 = [ours.state[p]["master"].clone() for p in model.parameters()]
    masters = [ours.state[p]["master"] for p in model.parameters()]
    assert all(torch.equal(m, a) for m, a in zip(masters, at_0, strict=True))  # steps 6..8 at lr 0 moved nothing
    assert_close(masters, list(reference.parameters()))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), masters, strict=True))


def test_a_schedule_reaching_0_mid_run_with_a_parameter_that_never_gets_a_gradient_equals_timm_lion():
    """A group with a parameter outside the loss takes the copying step too, which raised at lr 0."""
    model, reference = small_model(), small_model()
    unused, unused_ref = (nn.Parameter(torch.ones(5)) for _ in range(2))
    ours = DistributedLion([*model.parameters(), unused], lr=1e-2, weight_decay=0.1)
    theirs = Lion([*reference.parameters(), unused_ref], lr=1e-2, weight_decay=0.1)
    schedules = [warmup_from_0(o, total=6) for o in (ours, theirs)]
    mine, timm = run(model, ours, schedules[0], 9), run(reference, theirs, schedules[1], 9)
    assert all(torch.equal(p, q) for p, q in zip(mine[5], mine[-1], strict=True))  # lr 0 from step 6 on
    for a, b in zip(mine, timm, strict=True):
        assert_close(a, b)
    assert torch.equal(unused, torch.ones(5)) and "exp_avg" not in ours.state[unused]


@pytest.mark.parametrize("lr", [-1e-3, float("nan"), float("inf")])
def test_a_negative_or_non_finite_lr_is_refused_naming_lr_not_method_lr(lr):
    p = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"^DistributedLion: lr=\S+ must be finite and >= 0") as err:
        DistributedLion([p], lr=lr)
    assert "method.lr" not in str(err.value)
    with pytest.raises(ValueError, match=r"lr=\S+ of param group 1 must be finite and >= 0"):
        DistributedLion([{"params": [p]}, {"params": [nn.Parameter(torch.ones(2))], "lr": lr}], lr=1e-3)
    optimizer = DistributedLion([p], lr=1e-3)
    optimizer.param_groups[0]["lr"] = lr  # as a scheduler would set it
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"lr=\S+ of param group 0 must be finite and >= 0"):
        optimizer.step()
    assert torch.equal(p, torch.ones(3)) and not optimizer.state[p]  # refused before anything moved


def test_a_config_driven_run_still_refuses_lr_0_as_method_lr(make_cfg, tmp_path):
    """A run at lr 0 trains nothing: the runner's setting is method.lr, and it stays refused."""
    from distlion.train import run as train

    with pytest.raises(ValueError, match=r"^method.lr=0.0 must be > 0"):
        build_method("dlion", lr=0.0)
    with pytest.raises(ValueError, match=r"method.lr=0(\.0)? must be > 0"):
        train(make_cfg("method.lr=0"), tmp_path / "run")


def test_the_hugging_face_trainer_warms_up_from_0_as_with_timm_lion(tmp_path):
    """The README's recipe with a linear warm-up (the Trainer's scheduler starts at lr 0) in one process:
    its first step used to raise; now it moves nothing, and the run ends where timm's Lion in the Trainer does."""
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install 'distlion[hf]')")
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from distlion.hf import DistributedLionTrainer

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class Snapshots(TrainerCallback):
        """The lr each step runs at, and the parameters after it."""

        def __init__(self, model: nn.Module):
            self.model, self.lrs, self.after = model, [], []

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            self.lrs.append(optimizer.param_groups[0]["lr"])

        def on_step_end(self, args, state, control, **kwargs):
            self.after.append([p.detach().clone() for p in self.model.parameters()])

    def train(name: str, make_optimizer) -> tuple[list[torch.Tensor], Snapshots]:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16)
        net = LlamaForCausalLM(config)
        initial = [p.detach().clone() for p in net.parameters()]
        args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=4,
                                 learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=0.0,
                                 use_cpu=True, save_strategy="no", report_to=[], logging_steps=1, seed=0,
                                 disable_tqdm=True)
        snapshots = Snapshots(net)
        trainer = DistributedLionTrainer(model=net, args=args, train_dataset=Tokens(), callbacks=[snapshots],
                                         optimizers=(make_optimizer(net.parameters()), None))
        trainer.train()
        return initial, snapshots

    # zero_sign="zero": an embedding row no token used has update 0, which Lion's sign leaves at 0 (see DLion)
    initial, ours = train("ours", lambda params: DistributedLion(params, lr=1e-3, weight_decay=0.1, zero_sign="zero"))
    _, theirs = train("timm", lambda params: Lion(params, lr=1e-3, weight_decay=0.1))
    assert ours.lrs == theirs.lrs == [0.0, 5e-4, 1e-3]
    ours, theirs = ours.after, theirs.after
    assert all(torch.equal(p, q) for p, q in zip(ours[0], initial, strict=True))
    assert_close(ours[-1], theirs[-1])
    assert not all(torch.equal(p, q) for p, q in zip(ours[-1], initial, strict=True))
