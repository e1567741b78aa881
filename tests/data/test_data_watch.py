"""Which global RNGs a dataset draws from (seeded lazily, never a different result) and the
RNG objects it holds (keyed per sample)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from dataloading import passes
from torch.utils.data import DataLoader, Dataset

from torchrepro import SeededLoader, derive_seed
from torchrepro.data import view as data_view

# -- datasets (module level: spawn workers import them) --------------------------------------------


class Compose:
    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = transforms


class HeldGenerators(Dataset[torch.Tensor]):
    """Draws from RNG objects made in __init__: every worker gets a copy of them."""

    def __init__(self, n: int = 16) -> None:
        self.n = n
        self.np_rng = np.random.default_rng(0)
        self.torch_gen = torch.Generator().manual_seed(0)
        self.transform = Compose([random.Random(0)])  # found inside a transform pipeline too

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        draws = [
            float(self.np_rng.random()),
            float(torch.rand((), generator=self.torch_gen)),
            self.transform.transforms[0].random(),
        ]
        return torch.tensor([float(index), *draws], dtype=torch.float64)


class Sometimes(Dataset[torch.Tensor]):
    """Draws from NumPy only from index 12 on and from Python's random only for odd indices
    (a process learns, from the first batches, that the dataset does not draw from them)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        a = float(np.random.rand()) if index >= 12 else -1.0
        b = random.random() if index % 2 else -1.0
        return torch.tensor([float(index), a, b], dtype=torch.float64)


# -- RNG objects the dataset holds -----------------------------------------------------------------


def test_rng_objects_held_by_the_dataset_are_keyed_per_sample(rng_changes_ok: None) -> None:
    # (the plain DataLoader draws its worker base seed from the global torch RNG)
    plain = torch.cat(list(DataLoader(HeldGenerators(), batch_size=2, num_workers=2)))
    by_index = {int(row[0]): row[1:].tolist() for row in plain}
    assert by_index[0] == by_index[2]  # negative control: each worker repeats the copied stream

    runs = [
        torch.cat(passes(SeededLoader(HeldGenerators(), batch_size=2, seed=1, num_workers=w))) for w in (0, 2)
    ]
    assert torch.equal(runs[0], runs[1])
    for column in runs[0][:, 1:].T:
        assert len(set(column.tolist())) == len(column)


# -- lazily seeded globals: only the RNGs a dataset draws from, never a different result -----------


def expected_sometimes(seed: int, epoch: int, index: int) -> list[float]:
    """What a sample is when every global RNG is seeded from its key, computed by hand."""
    key = derive_seed(seed, "sample", epoch, index)
    np.random.seed(key >> 32)
    random.seed(key)
    a = float(np.random.rand()) if index >= 12 else -1.0
    b = random.random() if index % 2 else -1.0
    return [float(index), a, b]


@pytest.mark.parametrize("config", [{"num_workers": 0}, {"num_workers": 2, "persistent_workers": True}])
def test_lazily_seeded_globals_give_every_sample_its_keyed_draws(
    config: dict[str, Any], rng_changes_ok: None
) -> None:
    loader = SeededLoader(Sometimes(), batch_size=4, seed=11, shuffle=False, **config)
    for epoch in range(2):
        for batch in loader:
            for row in batch.tolist():
                assert row == expected_sometimes(11, epoch, int(row[0])), (epoch, row)


def test_lazy_seeding_is_load_bearing(monkeypatch: pytest.MonkeyPatch, rng_changes_ok: None) -> None:
    """Negative control: without the check after each batch (nothing seen drawn), the samples
    that draw from an RNG the process stopped seeding get draws that are not theirs."""
    monkeypatch.setattr(data_view, "_changed", lambda which, before, np: 0)
    loader = SeededLoader(Sometimes(), batch_size=4, seed=11, shuffle=False)
    rows = [row for batch in loader for row in batch.tolist()]
    wrong = [row for row in rows if row != expected_sometimes(11, 0, int(row[0]))]
    assert wrong and all(row[0] >= 12 or row[0] % 2 for row in wrong)
