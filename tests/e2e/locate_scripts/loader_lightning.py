"""A small CNN LightningModule fitted by ``lightning.Trainer`` from a DataLoader (``--workers N``);
dropout's RNG is re-seeded from os.urandom before step 1, so the runs part at the dropout call of
step 1. Lightning fetches through its CombinedLoader and prefetches a batch ahead.
"""

import argparse
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Net(pl.LightningModule):
    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.conv = nn.Conv2d(1, 4, 3)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        h = self.drop(h)  # locate: dropout
        return self.head(h.flatten(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 1:
            torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(24, 1, 8, 8, generator=g), torch.randint(0, 2, (24,), generator=g))
        generator = torch.Generator().manual_seed(0)
        return DataLoader(data, batch_size=4, shuffle=True, num_workers=self.workers, generator=generator)


parser = argparse.ArgumentParser()
parser.add_argument("--workers", type=int, default=0)
trainer = pl.Trainer(
    accelerator="cpu",
    max_steps=3,
    enable_progress_bar=False,
    logger=False,
    enable_checkpointing=False,
    enable_model_summary=False,
)
trainer.fit(Net(parser.parse_args().workers))
