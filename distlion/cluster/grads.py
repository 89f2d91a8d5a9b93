"""Per-worker gradients of one shared model replica.

All workers hold the same parameters x, so worker i's gradient is the gradient of its own mean
loss at x. The global batch arrives as one tensor whose rows are the workers' batches in order.

Three strategies, which must agree (tests/test_grads.py); benchmarks/bench_grads.py times them:

- `sequential`: one forward and backward per worker. Works for any model.
- `batched`: one forward and one backward over the global batch; each layer splits only its
  weight-gradient reduction by worker. The fastest; it knows a fixed set of layer types (those of
  timm ViTs and transformers LLaMA) and refuses any other model with `UnsupportedModelError`.
- `vmap`: `torch.func.vmap` of `torch.func.grad` over the workers. For comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distlion.flat import FlatParams

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
WorkerGrads = tuple[dict[torch.dtype, torch.Tensor], torch.Tensor]


def sequential_worker_grads(
    model: nn.Module,
    flat: FlatParams,
    per_example_loss: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    num_workers: int,
) -> WorkerGrads:
    """One backward pass per worker. Returns ({dtype: grads [N, numel]}, losses [N]).

    Each parameter's `.grad` is pointed at its slot in row i of the output, so backward writes the
    flat gradient in place with no gather copy.
    """
    grads = _zero_grads(flat, num_workers)
    losses = torch.empty(num_workers, device=flat.device)
    for i, (x, y) in enumerate(zip(inputs.chunk(num_workers), targets.chunk(num_workers), strict=True)):
        for dtype, params in flat.params.items():
            for p, seg in zip(params, flat.layouts[dtype], strict=True):
                p.grad = grads[dtype][i, seg.offset : seg.stop].view_as(p)
        loss = per_example_loss(model, x, y).mean()
        loss.backward()
        losses[i] = loss.detach()
    for params in flat.params.values():
        for p in params:
            p.grad = None
    return grads, losses


class UnsupportedModelError(ValueError):
    """The `batched` strategy cannot split this model's gradient by worker exactly."""


def batched_worker_grads(
    model: nn.Module,
    flat: FlatParams,
    per_example_loss: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    num_workers: int,
) -> WorkerGrads:
    """One forward and one backward over the global batch. Returns ({dtype: grads [N, numel]}, losses [N]).

    Give worker i its own copy θ_i of the parameters, all equal to θ, and let the rows of worker i
    (the set R_i, b = B/N rows) use only θ_i. The global objective

        L(θ_1, ..., θ_N) = Σ_i (1/b) Σ_{r ∈ R_i} ℓ_r(θ_i)

    then has ∂L/∂θ_i = ∇ mean_{r ∈ R_i} ℓ_r(θ), worker i's gradient, and one backward of L yields all N.
    The copies are never materialized (`expand` views of θ), and the forward uses θ itself. Only
    the reductions over rows that make a weight gradient are split by worker, e.g. for a linear
    layer y = x Wᵀ + b with grad-output G:

        dL/dx = G W  (whole batch, as usual),   dL/dW_i = Σ_{r ∈ R_i} G_rᵀ x_r,   dL/db_i = Σ_{r ∈ R_i} G_r.

    So the cost is one ordinary backward plus writing N gradients. Each module that holds
    parameters must be of a type in `_RULES` (timm ViTs: Linear, Conv2d, LayerNorm, LayerScale and the
    ViT's own cls/register tokens and position embedding; transformers LLaMA: Linear, Embedding,
    RMSNorm), see `_rule_for`; batch norm in training mode couples the workers' rows and is refused.
    Every layer must see the batch as dim 0, and the forward must treat rows independently (true for
    these models). A parameter used outside its module's forward would get a whole-batch gradient;
    that is detected after the backward and raises `UnsupportedModelError` rather than return it.
    """
    batch = inputs.shape[0]
    if batch % num_workers:
        raise ValueError(f"grad_strategy=batched: {batch} examples do not split over {num_workers} workers")
    rules = _plan(model)
    params = [p for group in flat.params.values() for p in group]
    copies = {p: p.detach().expand(num_workers, *p.shape).requires_grad_() for p in params}
    for p in params:
        p.grad = None
    with _per_worker_forwards(rules, _Pass(num_workers, batch, copies)):
        per_example = per_example_loss(model, inputs, targets)
    losses = per_example.view(num_workers, -1).mean(1)
    # Asking for θ's own gradient too: any use of θ outside the rules would show up there.
    found = torch.autograd.grad(losses.sum(), [*copies.values(), *params], allow_unused=True)
    leaked = [p for p, g in zip(params, found[len(params) :], strict=True) if g is not None]
    if leaked:
        names = {id(p): name for name, p in model.named_parameters()}
        raise UnsupportedModelError(
            f"grad_strategy=batched: {[names[id(p)] for p in leaked]} are used outside their module's "
            "forward, so their gradient cannot be split by worker; use cluster.grad_strategy=sequential"
        )
    grads = _zero_grads(flat, num_workers)
    by_param = dict(zip(params, found[: len(params)], strict=True))
    for dtype, group in flat.params.items():
        for p, seg in zip(group, flat.layouts[dtype], strict=True):
            if by_param[p] is not None:
                grads[dtype][:, seg.offset : seg.stop].copy_(by_param[p].reshape(num_workers, -1))
    return grads, losses.detach()


def vmap_worker_grads(
    model: nn.Module,
    flat: FlatParams,
    per_example_loss: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    num_workers: int,
) -> WorkerGrads:
    """`torch.func.vmap` over the workers of `grad` of a worker's mean loss.

    Returns ({dtype: grads [N, numel]}, losses [N]).
    """
    wrapper = _LossModule(model, per_example_loss)
    names = {id(p): f"model.{name}" for name, p in model.named_parameters()}
    params = {names[id(p)]: p.detach() for group in flat.params.values() for p in group}

    def worker_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(wrapper, params, (x, y)).mean()

    xs = inputs.view(num_workers, -1, *inputs.shape[1:])
    ys = targets.view(num_workers, -1, *targets.shape[1:])
    per_worker, losses = torch.func.vmap(
        torch.func.grad_and_value(worker_loss), in_dims=(None, 0, 0), randomness="different"
    )(params, xs, ys)
    grads = _zero_grads(flat, num_workers)
    for dtype, group in flat.params.items():
        for p, seg in zip(group, flat.layouts[dtype], strict=True):
            grads[dtype][:, seg.offset : seg.stop].copy_(per_worker[names[id(p)]].reshape(num_workers, -1))
    return grads, losses.detach()


STRATEGIES = {
    "sequential": sequential_worker_grads,
    "batched": batched_worker_grads,
    "vmap": vmap_worker_grads,
}


def worker_grads(strategy: str) -> Callable[..., WorkerGrads]:
    if strategy not in STRATEGIES:
        raise ValueError(f"cluster.grad_strategy={strategy!r} is unknown; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[strategy]


def _zero_grads(flat: FlatParams, num_workers: int) -> dict[torch.dtype, torch.Tensor]:
    return {d: torch.zeros(num_workers, b.numel(), dtype=d, device=b.device) for d, b in flat.buffers.items()}


class _LossModule(nn.Module):
    """`per_example_loss(model, x, y)` as a module, so `functional_call` can swap the model's parameters."""

    def __init__(self, model: nn.Module, per_example_loss: LossFn):
        super().__init__()
        self.model = model
        self.per_example_loss = per_example_loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.per_example_loss(self.model, x, y)


class _Pass:
    """What the rules of one batched pass share: N, B and each parameter's per-worker copies [N, *shape]."""

    def __init__(self, num_workers: int, batch: int, copies: dict[nn.Parameter, torch.Tensor]):
        self.num_workers = num_workers
        self.batch = batch
        self.copies = copies

    def of(self, p: torch.Tensor) -> torch.Tensor:
        """θ_i for every worker i; a frozen parameter's copies carry no gradient."""
        return self.copies[p] if p in self.copies else p.detach().expand(self.num_workers, *p.shape)

    def rows(self, p: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Row r holds its worker's copy of p, viewed as `shape`: [N, *p] -> [B, *shape]."""
        n, b = self.num_workers, self.batch // self.num_workers
        return self.of(p).reshape(n, 1, *shape).expand(n, b, *shape).reshape(n * b, *shape)

    def input(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        """The module's (first) input, checked to hold the global batch in dim 0."""
        x = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(x, torch.Tensor) or x.shape[0] != self.batch:
            raise UnsupportedModelError(
                f"grad_strategy=batched: a {type(module).__name__} got input {_describe(x)}, not the "
                f"global batch ({self.batch}) in dim 0, so its rows cannot be assigned to workers; "
                "use cluster.grad_strategy=sequential"
            )
        return x


def _describe(x: object) -> str:
    return f"of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"of type {type(x).__name__}"


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes matrix products in, where the caller's forward runs under autocast (`train.amp`)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _as_autocast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None):
    """A matrix product's operands as autocast casts them (none without autocast): the per-worker backward then
    computes in that dtype too, as autograd's own backward of the autocast op does. (The gradient of the fp32
    parameter copies comes back in fp32: autograd casts a gradient to its input's dtype.)"""
    if dtype is None:
        return x, weight, bias
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


class _LinearPerWorker(torch.autograd.Function):
    """y = x Wᵀ + b with the shared W; backward splits dW, db by worker (see `batched_worker_grads`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor | None):
        x, weight, bias = _as_autocast(x, weights[0], None if biases is None else biases[0], _autocast_dtype(x))
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.n = biases is not None, weights.shape[0]
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        n = ctx.n
        grad_x = g @ weight if ctx.needs_input_grad[0] else None
        g_workers = g.reshape(n, -1, g.shape[-1])
        x_workers = x.reshape(n, -1, x.shape[-1])
        grad_w = torch.bmm(g_workers.transpose(1, 2), x_workers) if ctx.needs_input_grad[1] else None
        grad_b = g_workers.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class _EmbeddingPerWorker(torch.autograd.Function):
    """y_r = E[id_r] with the shared E; backward scatters worker i's grad-rows into E_i (index_add)."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, tables: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.shape, ctx.padding_idx = tables.shape, padding_idx
        return F.embedding(ids, tables[0], padding_idx)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        (ids,) = ctx.saved_tensors
        n, vocab, dim = ctx.shape
        g = g.reshape(-1, dim)
        if ctx.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            g = g.masked_fill((ids == ctx.padding_idx).reshape(-1, 1), 0)
        # Worker i's ids index rows i*V .. i*V+V-1 of the stacked tables [N*V, D].
        rows = (ids.reshape(n, -1) + vocab * torch.arange(n, device=ids.device).unsqueeze(1)).reshape(-1)
        grad = torch.zeros(n * vocab, dim, dtype=g.dtype, device=g.device).index_add_(0, rows, g)
        return None, grad.view(n, vocab, dim), None


class _ConvPerWorker(torch.autograd.Function):
    """Convolution with the shared kernel; backward takes dK_i from worker i's images only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor | None, m: nn.Module):
        x, weight, bias = _as_autocast(x, weights[0], None if biases is None else biases[0], _autocast_dtype(x))
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.n = biases is not None, weights.shape[0]
        ctx.args = (m.stride, m.padding, m.dilation, False, (0,) * len(m.stride), m.groups)
        return torch.convolution(x, weight, bias, *ctx.args)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        x, w = ctx.saved_tensors
        n = ctx.n
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.convolution_backward(g, x, w, None, *ctx.args, [True, False, False])[0]
        if ctx.needs_input_grad[1]:
            grad_w = torch.stack([
                torch.ops.aten.convolution_backward(g_i, x_i, w, None, *ctx.args, [False, True, False])[1]
                for g_i, x_i in zip(g.chunk(n), x.chunk(n), strict=True)
            ])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.reshape(n, -1, g.shape[1], g[0, 0].numel()).sum((1, 3))
        return grad_x, grad_w, grad_b, None


class _LayerNormPerWorker(torch.autograd.Function):
    """y = x̂ ⊙ γ + β with the shared γ, β (x̂: each row normalized); backward splits by worker
    dγ_i = Σ_{r ∈ R_i} G_r ⊙ x̂_r and dβ_i = Σ_{r ∈ R_i} G_r, and takes dx from the fused kernel."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gammas: torch.Tensor | None, betas: torch.Tensor | None,
                shape: tuple[int, ...], eps: float) -> torch.Tensor:
        first = [None if t is None else t[0] for t in (gammas, betas)]
        if _autocast_dtype(x) is not None:  # autocast runs layer norm in fp32
            x = x.float()
        y, mean, rstd = torch.native_layer_norm(x, shape, *first, eps)
        ctx.save_for_backward(x, mean, rstd, gammas, betas)
        ctx.shape = shape
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        x, mean, rstd, gammas, betas = ctx.saved_tensors
        n = (gammas if gammas is not None else betas).shape[0]
        first = [None if t is None else t[0] for t in (gammas, betas)]
        grad_x = grad_gamma = grad_beta = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                g, x, ctx.shape, mean, rstd, *first, [True, False, False]
            )[0]
        g_workers = g.reshape(n, -1, *ctx.shape)
        if ctx.needs_input_grad[1]:
            normalized = ((x - mean) * rstd).reshape(g_workers.shape)
            grad_gamma = (g_workers * normalized).sum(1)
        if ctx.needs_input_grad[2]:
            grad_beta = g_workers.sum(1)
        return grad_x, grad_gamma, grad_beta, None, None


Rule = Callable[[nn.Module, _Pass, Callable, tuple, dict], torch.Tensor]


def _linear(m: nn.Linear, run: _Pass, original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    x = run.input(m, args, kwargs)
    return _LinearPerWorker.apply(x, run.of(m.weight), None if m.bias is None else run.of(m.bias))


def _embedding(m: nn.Embedding, run: _Pass, original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    ids = run.input(m, args, kwargs)
    if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
        raise UnsupportedModelError(
            "grad_strategy=batched handles nn.Embedding without max_norm, scale_grad_by_freq and sparse; "
            "use cluster.grad_strategy=sequential"
        )
    return _EmbeddingPerWorker.apply(ids, run.of(m.weight), m.padding_idx)


def _conv(m: nn.Module, run: _Pass, original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    x = run.input(m, args, kwargs)
    if isinstance(m.padding, str) or m.padding_mode != "zeros":
        raise UnsupportedModelError(
            "grad_strategy=batched handles convolutions with numeric zero padding only; "
            "use cluster.grad_strategy=sequential"
        )
    return _ConvPerWorker.apply(x, run.of(m.weight), None if m.bias is None else run.of(m.bias), m)


def _layer_norm(m: nn.LayerNorm, run: _Pass, original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    x = run.input(m, args, kwargs)
    gammas = None if m.weight is None else run.of(m.weight)
    betas = None if m.bias is None else run.of(m.bias)
    return _LayerNormPerWorker.apply(x, gammas, betas, tuple(m.normalized_shape), m.eps)


def _rms_norm(m: nn.RMSNorm, run: _Pass, original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """Normalize with no scale, then y_r = x̂_r ⊙ γ_i for r ∈ R_i (autograd splits dγ by worker)."""
    x = run.input(m, args, kwargs)
    y = F.rms_norm(x, m.normalized_shape, eps=m.eps)
    shape = (1,) * (x.ndim - 1 - len(m.normalized_shape)) + tuple(m.normalized_shape)
    return y if m.weight is None else y * run.rows(m.weight, shape)


def _substituted(names: tuple[str, ...], *, leading: bool) -> Rule:
    """Run the module's own forward with each named parameter p replaced by a per-row tensor whose
    row r is worker i's copy of p (r ∈ R_i). Exact when the forward only broadcasts p against the
    batch, which is why it is applied to a fixed list of modules whose code does so.

    leading=True: p has shape [1, ...] and dim 0 broadcasts over the batch (ViT tokens) -> [B, ...].
    leading=False: p broadcasts against the input's trailing dims (a norm's scale) -> [B, 1, .., *p].
    """

    def rule(m: nn.Module, run: _Pass, original: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        x = run.input(m, args, kwargs)
        saved = {name: m._parameters[name] for name in names if m._parameters.get(name) is not None}
        for name, p in saved.items():
            shape = tuple(p.shape[1:]) if leading else (1,) * (x.ndim - 1 - p.ndim) + tuple(p.shape)
            # Writing the dict directly keeps the parameters' order; torch.func.functional_call does the same.
            m._parameters[name] = run.rows(p, shape)
        try:
            return original(*args, **kwargs)
        finally:
            m._parameters.update(saved)

    return rule


_vit_tokens = _substituted(("cls_token", "reg_token", "pos_embed"), leading=True)


def _vision_transformer(m: nn.Module, run: _Pass, original: Callable, args: tuple, kwargs: dict):
    if m.dynamic_img_size:  # timm then resamples pos_embed with a reshape that assumes its dim 0 is 1
        raise UnsupportedModelError(
            "grad_strategy=batched handles timm's VisionTransformer without dynamic_img_size; "
            "use cluster.grad_strategy=sequential"
        )
    return _vit_tokens(m, run, original, args, kwargs)


# Exact classes only: a subclass may override forward and use its parameters differently.
_RULES: dict[str, tuple[Rule, tuple[str, ...]]] = {
    "torch.nn.modules.linear.Linear": (_linear, ("weight", "bias")),
    "torch.nn.modules.sparse.Embedding": (_embedding, ("weight",)),
    "torch.nn.modules.conv.Conv1d": (_conv, ("weight", "bias")),
    "torch.nn.modules.conv.Conv2d": (_conv, ("weight", "bias")),
    "torch.nn.modules.conv.Conv3d": (_conv, ("weight", "bias")),
    "torch.nn.modules.normalization.LayerNorm": (_layer_norm, ("weight", "bias")),
    "torch.nn.modules.normalization.RMSNorm": (_rms_norm, ("weight",)),
    "timm.layers.norm.LayerNorm": (_layer_norm, ("weight", "bias")),
    "timm.layers.layer_scale.LayerScale": (_substituted(("gamma",), leading=False), ("gamma",)),
    "timm.models.vision_transformer.VisionTransformer": (
        _vision_transformer,
        ("cls_token", "reg_token", "pos_embed"),
    ),
}


def _rule_for(m: nn.Module) -> tuple[Rule, tuple[str, ...]] | None:
    cls = type(m)
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    if qualname in _RULES:
        return _RULES[qualname]
    # transformers' RMSNorms (LlamaRMSNorm, MistralRMSNorm, ...) each scale the input elementwise by `weight`.
    if cls.__module__.startswith("transformers.models.") and cls.__name__.endswith("RMSNorm"):
        return _substituted(("weight",), leading=False), ("weight",)
    return None


def _plan(model: nn.Module) -> list[tuple[nn.Module, Rule]]:
    """The rule of every module that holds trainable parameters; raises for any module it cannot split."""
    plan = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            raise UnsupportedModelError(
                f"grad_strategy=batched: {name or 'the model'} ({type(m).__name__}) normalizes with "
                "statistics of the whole batch, which mixes the workers' rows; "
                "use cluster.grad_strategy=sequential"
            )
        own = [k for k, p in m.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        found = _rule_for(m)
        unknown = [k for k in own if found is None or k not in found[1]]
        if unknown:
            raise UnsupportedModelError(
                f"grad_strategy=batched cannot split the gradient of {name or 'the model'} "
                f"({type(m).__module__}.{type(m).__qualname__}, parameters {unknown}) by worker; it handles "
                f"{sorted({c.rsplit('.', 1)[1] for c in _RULES})} and transformers' RMSNorms. "
                "Use cluster.grad_strategy=sequential"
            )
        plan.append((m, found[0]))
    return plan


class _per_worker_forwards:
    """Within the block, each planned module's forward is its rule (an instance attribute that
    shadows the class's forward); on exit the modules are restored."""

    def __init__(self, plan: list[tuple[nn.Module, Rule]], run: _Pass):
        self.plan, self.run = plan, run

    def __enter__(self) -> None:
        self.saved = [(m, m.__dict__.get("forward")) for m, _ in self.plan]
        for m, rule in self.plan:
            m.forward = _bind(rule, m, self.run, m.forward)

    def __exit__(self, *exc: object) -> None:
        for m, forward in self.saved:
            if forward is None:
                del m.forward
            else:
                m.forward = forward


def _bind(rule: Rule, m: nn.Module, run: _Pass, original: Callable) -> Callable[..., torch.Tensor]:
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return rule(m, run, original, args, kwargs)

    return forward
