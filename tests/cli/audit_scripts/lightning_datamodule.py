"""A Lightning run whose DataLoader Lightning builds from a DataModule (audit fixture): the dataset
draws from Python's global random, which nothing seeds (no seed_everything)."""

import random

import lightning as L
import torch
from torch.utils.data import Dataset


class Flip(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.arange(4.0) + i
        return x.flip(0) if random.random() < 0.5 else x


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.set_num_threads(1)
datamodule = L.LightningDataModule.from_datasets(train_dataset=Flip(), batch_size=4)
trainer = L.Trainer(
    max_steps=1,
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Model(), datamodule=datamodule)
