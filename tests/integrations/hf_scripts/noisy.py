"""The dataset and model of train.py (importable without transformers)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Noisy(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed inputs plus a random augmentation drawn from the global torch RNG."""

    def __init__(self, n: int = 44) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i] + 0.3 * torch.randn(8), "labels": self.y[i]}


class Net(nn.Module):
    """A small MLP with dropout, returning the loss the way HF models do."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.3)
        self.l2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.l2(self.drop(torch.relu(self.l1(x)))).squeeze(-1)
        return {"loss": F.mse_loss(out, labels)}
