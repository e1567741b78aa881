"""Datasets and helpers the tests of ``torchrepro.data`` share (module level: spawn workers
import the datasets by this module's name)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from torchrepro import SeededLoader, sample_rng


class Draws(Dataset[torch.Tensor]):
    """Sample i: [i, and one draw from every RNG a dataset may use]."""

    def __init__(self, n: int = 23, *, use_sample_rng: bool = True) -> None:
        self.n = n
        self.use_sample_rng = use_sample_rng

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        extra = [sample_rng().random()] if self.use_sample_rng else []
        draws = [random.random(), float(np.random.rand()), float(torch.rand(()))]
        return torch.tensor([float(index), *draws, *extra], dtype=torch.float64)


def collate_with_draw(samples: list[torch.Tensor]) -> torch.Tensor:
    """A collate_fn that draws: its draw must be keyed by (seed, epoch, batch index)."""
    batch = torch.stack(samples)
    return torch.cat([batch, torch.rand(len(samples), 1, dtype=torch.float64)], dim=1)


def passes(loader: Any, epochs: int = 2) -> list[torch.Tensor]:
    return [batch for _ in range(epochs) for batch in loader]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    pairs = zip(a, b, strict=False)
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


def global_states() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def assert_same_states(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[0] == b[0]
    assert a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1]) and a[1][2:] == b[1][2:]
    assert torch.equal(a[2], b[2])


def order(loader: SeededLoader) -> list[int]:
    return [int(i) for batch in loader for i in batch]
