"""A plain Lightning fit, as its users write it, that resumes from ``ckpt/last.ckpt``; no torchrepro.

Usage: python lightning_last.py [--resume]      (in the directory it works in; relative paths only)

``lightning.seed_everything(0)``, a small MLP with dropout trained with Adam on 48 fixed samples
through ``DataLoader(shuffle=True)`` in batches of 8: 2 epochs of 6 steps, 12 optimizer steps, on
the CPU. ``ModelCheckpoint`` writes ``ckpt/last.ckpt`` after every optimizer step (and no other
checkpoint); ``--resume`` fits with ``ckpt_path="last"``, which finds it.

- Prints ``START_STEP <n>``: the trainer's ``global_step`` when training starts (0, or the step of
  the checkpoint resumed from).
- Writes the model's final ``state_dict`` to ``final.pt``.
- With ``RESUME_CRASH_AFTER=K`` in the environment it SIGKILLs itself as the batch after optimizer
  step K starts, so the checkpoint of step K is complete on disk.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from typing import Any

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

warnings.filterwarnings("ignore")  # few workers, a non-resumable loader resumed mid-epoch: expected here


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """48 fixed samples (the same in every process)."""

    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Net(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Probe(lightning.Callback):
    """Prints ``START_STEP``; SIGKILLs the process as the batch after step ``crash_after`` starts."""

    def __init__(self, crash_after: int | None) -> None:
        self.crash_after = crash_after

    def on_train_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        print(f"START_STEP {trainer.global_step}", flush=True)

    def on_train_batch_start(self, trainer: lightning.Trainer, *args: Any) -> None:
        if trainer.global_step == self.crash_after:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    crash_after = os.environ.get("RESUME_CRASH_AFTER")

    lightning.seed_everything(0, verbose=False)
    model = Net()
    loader = DataLoader(Points(), batch_size=8, shuffle=True, num_workers=0)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        default_root_dir=".",
        callbacks=[
            Probe(int(crash_after) if crash_after else None),
            ModelCheckpoint(dirpath="ckpt", every_n_train_steps=1, save_top_k=0, save_last=True),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, ckpt_path="last" if args.resume else None)
    if trainer.is_global_zero:
        torch.save(model.state_dict(), "final.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
