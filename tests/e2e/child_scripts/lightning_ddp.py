"""Lightning ``strategy="ddp"`` on 2 CPU processes: Lightning starts rank 1 as a new
``python lightning_ddp.py``. ``--noisy``: rank 1's samples get unseeded noise."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Points, model


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    noisy = "--noisy" in sys.argv and os.environ.get("LOCAL_RANK") == "1"  # set in rank 1 only
    data = DataLoader(Points(noisy=noisy), batch_size=4, shuffle=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), data)
    # Leave the process group together and explicitly: a rank whose gloo group is torn down at
    # interpreter exit, while the other still uses it, can abort ("terminate called without an
    # active exception", exit 134), which a check reports as a failed script.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
