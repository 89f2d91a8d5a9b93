"""The Triton kernels of D-Lion on CUDA (distlion/kernels/dlion_triton.py): bit for bit the eager ops, or not used.

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, on values where every
operation is exact, so that the packing, the ties, the tails and both lerp formulas are checked against the eager
ops whatever the rounding; the interpreter's fma rounds twice, which the check at load must reject. On a CUDA
machine (`scripts/gpu_check.sh`) the tests named `cuda` check the compiled kernels themselves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from distlion import Simulation, kernels
from distlion.comm.message import Message
from distlion.comm.voting import tie_byte
from distlion.methods import StepContext, build_method
from distlion.methods.dlion import DLion, checked_cuda_kernels, reproduces_eager

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def exact_values(n: int, gen: torch.Generator) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2]: with b1 = 1/2 and 1 - b2 in {1/4, 3/4} every product and sum below is exact,
    so fused and unfused arithmetic agree, and m = -g (an update of exactly 0, a tie) is common."""
    return torch.randint(-16, 17, (n,), generator=gen, device="cpu").float() / 8


def eager(betas: tuple[float, float], zero_sign: str, params: torch.Tensor) -> DLion:
    method = DLion(lr=1e-3, betas=betas, weight_decay=0.25, zero_sign=zero_sign)
    method.fused = False
    return method.bind(params, 1)


CASES = [(n, betas, zero_sign, step) for n in (1, 7, 8, 4096, 2 * 4096 + 13)
         for betas in ((0.5, 0.75), (0.5, 0.25))  # lerp weight 1/4 and 3/4: both of its formulas
         for zero_sign, step in (("alternate", 0), ("alternate", 1), ("positive", 0), ("negative", 0))]


def interpreted_checks() -> dict[str, Any]:
    """What the kernels do in Triton's interpreter (run in a process of its own: TRITON_INTERPRET=1 must be set
    before triton is imported)."""
    from distlion.kernels.dlion_triton import DLionTritonKernels

    fused, out = DLionTritonKernels(), {"differ": [], "refused": []}
    for n, betas, zero_sign, step in CASES:
        gen = torch.Generator(device="cpu").manual_seed(n)
        momentum, grad, params = exact_values(n, gen), exact_values(n, gen), exact_values(n, gen)
        grad[::5] = -momentum[::5]  # ties
        method = eager(betas, zero_sign, params.clone())
        ctx = StepContext(step=step, lr=1 / 16, num_workers=1)
        expected = {"momentum": momentum.clone()}
        signs = method.worker_rule(grad, expected, ctx)["signs"]
        fused_momentum, fused_signs = momentum.clone(), torch.full_like(signs, 0xA5)  # stale bytes: overwritten
        fused.rule(grad, fused_momentum, fused_signs, betas, tie_byte(zero_sign, step))
        method.apply_rule(Message({"vote": signs}), ctx)
        fused.apply(params, signs, ctx.lr, method.weight_decay)
        for name, a, b in (("signs", fused_signs, signs), ("momentum", fused_momentum, expected["momentum"]),
                           ("params", params, method.params)):
            if not torch.equal(a, b):
                out["differ"].append(f"{name} of n={n} betas={betas} {zero_sign} step {step}")
    out["cases"] = len(CASES)
    out["probe_reproduced"] = reproduces_eager(fused, (0.9, 0.99), "cpu")
    momentum, signs = torch.zeros(16), torch.zeros(2, dtype=torch.uint8)
    for call in (lambda: fused.rule(torch.zeros(32)[::2], momentum, signs, (0.9, 0.99), 0),
                 lambda: fused.rule(torch.zeros(17), momentum, signs, (0.9, 0.99), 0),
                 lambda: fused.apply(momentum, torch.zeros(3, dtype=torch.uint8), 1e-3, 0.0)):
        try:
            call()
        except ValueError as error:
            out["refused"].append(str(error))
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@needs_triton
def test_the_triton_kernels_pack_ties_and_apply_as_the_eager_ops(interpreted):
    """Every length (a tail byte, several programs), both lerp formulas, every tie byte: signs, momenta and the
    MaVo apply equal the eager ops' where no rounding is involved."""
    assert interpreted["cases"] == len(CASES) and interpreted["differ"] == []


@needs_triton
def test_the_check_at_load_rejects_a_kernel_that_rounds_otherwise(interpreted):
    """The interpreter computes fma(a, b, c) as a * b + c in two roundings: on the probe, where rounding decides
    the sign of updates near 0, that is not the eager ops' result, and the kernels would not be used."""
    assert interpreted["probe_reproduced"] is False


@needs_triton
def test_the_triton_kernels_refuse_tensors_they_cannot_read(interpreted):
    first, second, third = interpreted["refused"]
    assert "contiguous torch.float32" in first
    assert "17 gradients" in second
    assert "3 vote bytes for 16" in third


def test_cpu_parameters_never_load_the_triton_kernels(monkeypatch):
    def refuse():
        raise AssertionError("the Triton kernels were loaded for CPU parameters")

    monkeypatch.setattr(kernels, "dlion_cuda", refuse)
    build_method("dlion", lr=1e-2).bind(torch.zeros(10), 2)


@needs_cuda
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.95, 0.98), (0.5, 0.3), (0.0, 0.0)])
def test_on_cuda_the_triton_kernels_pass_their_check(betas):
    device = torch.device("cuda", torch.cuda.current_device())
    assert checked_cuda_kernels(betas, device) is not None, kernels.status("dlion_cuda")
    assert kernels.status("dlion_cuda") == "on"


@needs_cuda
@pytest.mark.parametrize("zero_sign", ["alternate", "positive", "negative"])
@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
def test_on_cuda_fused_and_eager_runs_are_bitwise_equal(zero_sign, aggregation):
    """Whole simulated runs on CUDA, fused against eager: parameters, every worker's momentum and the bits, with
    exact zeros (ties) at every step and a size that is no multiple of 8 or of a Triton program."""
    n, workers = 3 * 4096 + 13, 3
    gen = torch.Generator(device="cpu").manual_seed(0)
    grads = [torch.randn(workers, n, generator=gen, device="cpu").cuda() for _ in range(3)]
    for g in grads:
        g[:, ::7] = 0

    def run(fused: bool):
        method = build_method("dlion", lr=1e-2, weight_decay=0.1, aggregation=aggregation, zero_sign=zero_sign)
        method.fused = fused
        start = torch.linspace(-1, 1, n, device="cuda")
        sim = Simulation(method, [torch.nn.Parameter(start)], workers)
        results = [sim.step([[g] for g in step]) for step in grads]
        (bound,) = sim.cluster.buffers[torch.float32].appliers
        assert (bound._kernels is not None) == fused, kernels.status("dlion_cuda")
        momenta = [state["momentum"].clone() for state in results[-1].worker_states]
        return sim.params[0].clone(), momenta, [(r.bits_up, r.bits_down) for r in results]

    fused, unfused = run(True), run(False)
    assert torch.equal(fused[0], unfused[0])
    assert all(torch.equal(a, b) for a, b in zip(fused[1], unfused[1], strict=True))
    assert fused[2] == unfused[2]


if __name__ == "__main__":  # the interpreter's process (see `interpreted`)
    print(json.dumps(interpreted_checks()))
