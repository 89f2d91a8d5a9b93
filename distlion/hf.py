"""`DistributedLion` in a Hugging Face `Trainer` (which needs `accelerate`: `pip install 'distlion[hf]'`).

    trainer = DistributedLionTrainer(model=model, args=args, train_dataset=train_dataset,
                                     optimizers=(DistributedLion(model.parameters(), lr=1e-4), None))

Under torchrun the `Trainer` wraps the model in `DistributedDataParallel`, which would all-reduce fp32
gradients underneath the optimizer: this Trainer gives DDP the no-op comm hook, so each rank keeps its own
gradient and `DistributedLion` exchanges the signs. A checkpoint also holds every rank's own optimizer state
(`optimizer.rank{R}.pt`; the momenta differ by rank) and resuming loads it: the plain `Trainer` saves rank 0's
`optimizer.pt` only, and loading it into every rank changes the run (`DistributedLion` refuses it).

`args.max_grad_norm` (1.0 by default) clips each rank's own gradient before its sign: that changes the signs
(it rescales g against the momentum), as it would Lion's; set it to 0 to run D-Lion as the paper does.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer


class DistributedLionTrainer(Trainer):
    """A `Trainer` for `DistributedLion`: no gradient all-reduce, and per-rank optimizer state in checkpoints."""

    def training_step(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(model, DistributedDataParallel) and not getattr(model, "_distlion_noop_hook", False):
            model.register_comm_hook(None, noop_hook)  # DistributedLion exchanges the signs itself
            model._distlion_noop_hook = True
        return super().training_step(model, *args, **kwargs)

    def _rank_file(self, directory: str) -> str:
        return os.path.join(directory, f"optimizer.rank{self.args.process_index}.pt")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)  # rank 0 makes it when it saves the model, maybe after this rank
        torch.save(self.optimizer.state_dict(), self._rank_file(output_dir))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)  # the scheduler, and rank 0's optimizer.pt
        if checkpoint is None:
            return
        path = self._rank_file(checkpoint)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: this checkpoint holds no optimizer state of rank "
                                    f"{self.args.process_index}; resume from one that DistributedLionTrainer saved")
        # (load_state_dict moves each state tensor to its parameter's device)
        self.optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
