"""The datasets and model of train.py (importable without transformers)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

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


SHARD_LENGTHS = [7, 3, 0, 9, 5, 6, 4, 2]  # 36 samples: 9 batches of 4 an epoch
READS: Path | None = None  # where read_shard notes the shards it opens


def read_shard(shard: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Shard ``shard`` from offset ``start``: fixed inputs plus noise from the global torch RNG.
    Each open is noted in ``READS/reads.<pid>.txt`` as ``shard start seed`` (torch's initial seed
    when the shard opens: the streamed loader sets it from (seed, epoch, shard, start))."""
    if READS is not None:
        with open(READS / f"reads.{os.getpid()}.txt", "a") as f:
            f.write(f"{shard} {start} {torch.initial_seed()}\n")
    g = torch.Generator().manual_seed(100 + shard)
    x = torch.randn(SHARD_LENGTHS[shard], 8, generator=g)
    y = x.sum(1) + 0.1 * torch.randn(SHARD_LENGTHS[shard], generator=g)
    for i in range(start, SHARD_LENGTHS[shard]):
        yield {"x": x[i] + 0.3 * torch.randn(8), "labels": y[i]}


def hf_stream(num_shards: int = 6) -> object:
    """The same kind of data as a Hugging Face ``datasets.IterableDataset`` (6 shards of 36
    samples), with a noise ``map`` drawing from the global torch RNG as each sample is read."""
    import datasets

    g = torch.Generator().manual_seed(2)
    x = torch.randn(36, 8, generator=g)
    table = {"x": x.tolist(), "labels": (x.sum(1) + 0.1 * torch.randn(36, generator=g)).tolist()}

    def noise(sample: dict[str, list[float]]) -> dict[str, list[float]]:
        return {"x": (torch.tensor(sample["x"]) + 0.3 * torch.randn(8)).tolist()}

    return datasets.Dataset.from_dict(table).to_iterable_dataset(num_shards=num_shards).map(noise)
