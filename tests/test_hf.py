"""The Hugging Face `Trainer` recipe (`distlion.hf.DistributedLionTrainer`) over 2 gloo ranks, as a user runs it:
a tiny transformers LLaMA, a checkpoint after 3 of 6 steps, and a resume from it.

Run as a script under torchrun, this file is each rank's program (`worker`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STEPS, SAVE_AT = 6, 3
JOB_LIMIT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    pytest.importorskip("accelerate", reason="the Trainer recipe needs accelerate (pip install 'distlion[hf]')")
    out = tmp_path_factory.mktemp("hf")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", __file__, str(out)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=JOB_LIMIT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out


def test_resuming_from_a_checkpoint_continues_the_uninterrupted_run_bitwise(job):
    """Each rank saved and loaded its own momenta: the resumed run ends where the uninterrupted one did."""
    for rank in range(2):
        assert (job / "full" / f"checkpoint-{SAVE_AT}" / f"optimizer.rank{rank}.pt").is_file()
    full, resumed = (torch.load(job / f"{name}.params.pt") for name in ("full", "resumed"))
    assert all(torch.equal(p, q) for p, q in zip(full, resumed, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(full, torch.load(job / "initial.params.pt"), strict=True))


def test_the_plain_trainer_s_resume_loads_rank_0_s_momenta_into_every_rank_and_is_refused(job):
    errors = json.loads((job / "errors.json").read_text())
    assert "holds the same momenta" in errors["plain_resume"]


def test_a_ddp_all_reduce_under_distributed_lion_is_refused(job):
    """The plain Trainer without the no-op hook: DDP averages the gradients before DistributedLion sees them."""
    errors = json.loads((job / "errors.json").read_text())
    assert "every rank holds the same gradient" in errors["no_hook"]


# --------------------------------------------------------------------------------------------------
# Each rank's program


def worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from distlion import DistributedLion
    from distlion.hf import DistributedLionTrainer

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def model() -> LlamaForCausalLM:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16)
        return LlamaForCausalLM(config)

    def train(name: str, trainer_class: type = DistributedLionTrainer, resume: str | None = None,
              steps: int = STEPS) -> list[torch.Tensor]:
        net = model()
        args = TrainingArguments(output_dir=str(out / name), max_steps=steps, per_device_train_batch_size=4,
                                 save_steps=SAVE_AT, save_strategy="steps", learning_rate=1e-3,
                                 lr_scheduler_type="constant", max_grad_norm=0.0, use_cpu=True, ddp_backend="gloo",
                                 report_to=[], logging_steps=1, seed=0, disable_tqdm=True)
        optimizer = DistributedLion(net.parameters(), lr=1e-3, weight_decay=0.1)
        trainer = trainer_class(model=net, args=args, train_dataset=Tokens(), optimizers=(optimizer, None))
        trainer.train(resume_from_checkpoint=resume)
        return [p.detach().clone() for p in net.parameters()]

    rank = int(os.environ["RANK"])
    initial = [p.detach().clone() for p in model().parameters()]
    full = train("full")
    resumed = train("resumed", resume=str(out / "full" / f"checkpoint-{SAVE_AT}"))
    errors = {}
    for case, trainer_class, resume in (("plain_resume", PlainRecipe, str(out / "full" / f"checkpoint-{SAVE_AT}")),
                                        ("no_hook", Trainer, None)):
        try:
            train(case, trainer_class, resume)
        except RuntimeError as err:
            errors[case] = str(err)
    if rank == 0:
        for name, params in (("initial", initial), ("full", full), ("resumed", resumed)):
            torch.save(params, out / f"{name}.params.pt")
        (out / "errors.json").write_text(json.dumps(errors))
    dist.barrier()


def _plain_recipe():
    """The recipe as the README gave it before: the no-op hook, but the Trainer's own (rank 0's) optimizer.pt."""
    from distlion.hf import DistributedLionTrainer

    class Plain(DistributedLionTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            super(DistributedLionTrainer, self)._save_optimizer_and_scheduler(output_dir)

        def _load_optimizer_and_scheduler(self, checkpoint):
            super(DistributedLionTrainer, self)._load_optimizer_and_scheduler(checkpoint)

    return Plain


if __name__ == "__main__":
    PlainRecipe = _plain_recipe()
    worker(Path(sys.argv[1]))
