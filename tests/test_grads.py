"""Per-worker gradient strategies: `batched` and `vmap` against `sequential` (one backward per worker)."""

from __future__ import annotations

import json
from pathlib import Path

import hydra
import pytest
import torch
import torch.nn.functional as F
import transformers
from omegaconf import OmegaConf
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from distlion.cluster.grads import (
    STRATEGIES,
    UnsupportedModelError,
    batched_worker_grads,
    sequential_worker_grads,
    worker_grads,
)
from distlion.flat import FlatParams
from distlion.train import run

VIT_DIGITS = Path(__file__).resolve().parent.parent / "conf" / "model" / "vit_digits.yaml"
PER_WORKER = 2


def class_loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def token_loss(model, x, y):
    """Mean next-token cross-entropy of each sequence."""
    return F.cross_entropy(model(input_ids=x).logits.transpose(1, 2), y, reduction="none").mean(1)


def vit_digits():
    model = hydra.utils.instantiate(OmegaConf.load(VIT_DIGITS))
    return model, lambda b: (torch.randn(b, 1, 8, 8), torch.randint(0, 10, (b,))), class_loss


def vit_cifar():
    model = VisionTransformer(img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=64, depth=2,
                              num_heads=4)
    return model, lambda b: (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))), class_loss


def vit_extras():
    """Layer scale, qk-norm, register tokens and the deit-3 position embedding: the other ViT rules."""
    model = VisionTransformer(img_size=16, patch_size=4, in_chans=3, num_classes=10, embed_dim=32, depth=2,
                              num_heads=2, init_values=0.1, qk_norm=True, reg_tokens=2, no_embed_class=True)
    return model, lambda b: (torch.randn(b, 3, 16, 16), torch.randint(0, 10, (b,))), class_loss


def llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    return model, lambda b: (torch.randint(0, 64, (b, 12)), torch.randint(0, 64, (b, 12))), token_loss


class TorchLayers(nn.Module):
    """The torch layers ViT and LLaMA do not use: Conv1d, nn.RMSNorm, padding_idx, a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8, padding_idx=0)
        self.conv = nn.Conv1d(8, 8, kernel_size=3, padding=1, stride=2)
        self.rms = nn.RMSNorm(8)
        self.norm = nn.LayerNorm(8, bias=False)
        self.norm.weight.requires_grad_(False)
        self.head = nn.Linear(8, 5)

    def forward(self, ids):
        h = self.conv(self.embed(ids).transpose(1, 2)).transpose(1, 2)
        return self.head(self.norm(self.rms(h))).mean(1)


def torch_layers():
    return TorchLayers(), lambda b: (torch.randint(0, 16, (b, 10)), torch.randint(0, 5, (b,))), class_loss


def assert_same_worker_grads(model, data, loss, num_workers, strategy):
    torch.manual_seed(1)
    model.train()
    flat = FlatParams(model)
    inputs, targets = data(num_workers * PER_WORKER)
    expected, expected_losses = sequential_worker_grads(model, flat, loss, inputs, targets, num_workers)
    grads, losses = STRATEGIES[strategy](model, flat, loss, inputs, targets, num_workers)
    for dtype, g in expected.items():
        assert grads[dtype].shape == g.shape == (num_workers, flat.buffers[dtype].numel())
        for seg in flat.layouts[dtype]:  # each parameter against its own scale, so a small one cannot hide
            want, got = g[:, seg.offset : seg.stop], grads[dtype][:, seg.offset : seg.stop]
            assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-7 * g.abs().max(), seg.name
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for group in flat.params.values() for p in group)


@pytest.mark.parametrize("num_workers", [1, 3, 4])
@pytest.mark.parametrize("build", [vit_digits, vit_cifar, vit_extras, llama, torch_layers])
def test_batched_equals_sequential(build, num_workers):
    torch.manual_seed(0)
    assert_same_worker_grads(*build(), num_workers, "batched")


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap has no batching rule for attention
@pytest.mark.parametrize("build", [vit_digits, llama])
def test_vmap_equals_sequential(build):
    torch.manual_seed(0)
    assert_same_worker_grads(*build(), 3, "vmap")


def test_tied_embeddings_get_both_uses():
    """lm_head shares the embedding table: each worker's gradient sums both uses, as autograd does."""
    torch.manual_seed(0)
    model, data, loss = llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    assert_same_worker_grads(model, data, loss, 3, "batched")


def test_model_is_restored_after_batched_pass():
    torch.manual_seed(0)
    model, data, loss = vit_cifar()
    before = {name: type(p) for name, p in model.named_parameters()}
    flat = FlatParams(model)
    batched_worker_grads(model, flat, loss, *data(4), num_workers=2)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert {name: type(p) for name, p in model.named_parameters()} == before


class LinearWithScale(nn.Linear):
    """A subclass whose forward differs from nn.Linear's: the rule for nn.Linear must not apply."""

    def forward(self, x):
        return 2 * super().forward(x)


class WeightReader(nn.Module):
    """Uses its child's weight directly instead of calling the child."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return F.linear(x, self.fc.weight, self.fc.bias)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)), "statistics of the whole batch"),
        (nn.Sequential(nn.Linear(4, 4), nn.PReLU(), nn.Linear(4, 3)), r"gradient of 1 \(.*PReLU"),
        (nn.Sequential(LinearWithScale(4, 3)), "cannot split the gradient of 0"),
        (WeightReader(), r"\['fc.weight', 'fc.bias'\] are used outside their module's forward"),
        (VisionTransformer(img_size=8, patch_size=4, num_classes=3, embed_dim=8, depth=1, num_heads=1,
                           dynamic_img_size=True), "without dynamic_img_size"),
    ],
)
def test_unsupported_models_raise_a_clear_error(model, message):
    flat = FlatParams(model)
    inputs = torch.randn(6, 3, 8, 8) if isinstance(model, VisionTransformer) else torch.randn(6, 4)
    targets = torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError, match=message) as err:
        batched_worker_grads(model, flat, class_loss, inputs, targets, 3)
    assert "cluster.grad_strategy=sequential" in str(err.value)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_a_layer_that_does_not_see_the_batch_in_dim_0_raises():
    model = nn.Sequential(nn.Flatten(0, 1), nn.Linear(4, 3), nn.Unflatten(0, (6, 5)))
    flat = FlatParams(model)
    inputs, targets = torch.randn(6, 5, 4), torch.zeros(6)
    with pytest.raises(UnsupportedModelError, match=r"input of shape \(30, 4\), not the global batch \(6\)"):
        batched_worker_grads(model, flat, lambda m, x, y: m(x).sum((1, 2)), inputs, targets, 3)


def test_strategy_registry():
    assert worker_grads("batched") is batched_worker_grads
    with pytest.raises(ValueError, match="grad_strategy='fast' is unknown"):
        worker_grads("fast")


@pytest.mark.slow
def test_training_with_batched_follows_sequential(make_cfg, tmp_path):
    """Three D-Lion steps on digits: the same losses whichever way the gradients were computed."""
    curves = {}
    for strategy in ("sequential", "batched"):
        cfg = make_cfg("cluster.workers=4", "cluster.per_worker_batch=8", "train.steps=3",
                       "train.eval_every=3", "train.log_every=1", f"cluster.grad_strategy={strategy}")
        run(cfg, tmp_path / strategy)
        lines = (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()
        curves[strategy] = [json.loads(line)["train_loss"] for line in lines]
    assert curves["batched"] == pytest.approx(curves["sequential"], abs=1e-4)
