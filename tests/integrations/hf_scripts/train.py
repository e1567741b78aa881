"""Train a tiny model with the Hugging Face Trainer; write the final weights of each run.

    python train.py run KIND:WORKERS:DIR [...]        train from scratch, checkpoints every 4 steps
    python train.py resume KIND:WORKERS:CHECKPOINT:DIR [...]   resume from CHECKPOINT

KIND is ``repro`` (TorchreproTrainer) or ``stock`` (transformers.Trainer). Each run writes
``DIR/final.pt`` (the model's state dict). 44 samples, batch 4, accumulation 2: 11 batches and
6 optimizer steps per epoch (the last with one batch), 2 epochs, 12 steps. The dataset draws a
random augmentation from the global torch RNG in ``__getitem__`` and the model has dropout, so the
data order, the augmentation and the model's RNG stream all show in the weights.
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from torch import nn
from torch.nn import functional as F

from torchrepro.integrations.transformers import TorchreproTrainer


class Noisy(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 44) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i] + 0.3 * torch.randn(8), "labels": self.y[i]}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.3)
        self.l2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.l2(self.drop(torch.relu(self.l1(x)))).squeeze(-1)
        return {"loss": F.mse_loss(out, labels)}


def train(kind: str, workers: int, out: str, checkpoint: str | None) -> None:
    torch.manual_seed(0)
    model = Net()
    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=0.05,
        save_strategy="steps",
        save_steps=4,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=workers,
    )
    cls: Any = TorchreproTrainer if kind == "repro" else transformers.Trainer
    trainer = cls(model=model, args=args, train_dataset=Noisy())
    trainer.train(resume_from_checkpoint=checkpoint)
    torch.save(model.state_dict(), os.path.join(out, "final.pt"))


def main(argv: list[str]) -> None:
    mode, specs = argv[0], argv[1:]
    for spec in specs:
        if mode == "run":
            kind, workers, out = spec.split(":")
            train(kind, int(workers), out, None)
        else:
            kind, workers, checkpoint, out = spec.split(":")
            train(kind, int(workers), out, checkpoint)


if __name__ == "__main__":
    main(sys.argv[1:])
