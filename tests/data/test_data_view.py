"""The seeding view (loader.dataset): per-sample keys, collate keyed by batch, sample_rng,
datasets that load whole batches."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from dataloading import Draws, collate_with_draw, passes, same
from torch.utils.data import Dataset

from torchrepro import ReproError, SeededLoader, derive_seed, sample_rng

# -- datasets (module level: spawn workers import them) --------------------------------------------


class Batched(Dataset[torch.Tensor]):
    """Loads whole batches through __getitems__."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> torch.Tensor:
        raise AssertionError("SeededLoader should call __getitems__")

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [torch.tensor([float(i), float(torch.rand(()))], dtype=torch.float64) for i in indices]


class Keys(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> torch.Tensor:
        first, again = sample_rng(), sample_rng()
        assert first is again  # one generator per sample: two calls never repeat draws
        return torch.tensor([index, torch.initial_seed(), first.integers(2**62)], dtype=torch.float64).to(
            torch.float64
        )


# -- per-sample keys -------------------------------------------------------------------------------


def test_sample_keys_are_derive_seed_of_seed_epoch_index() -> None:
    loader = SeededLoader(Keys(), batch_size=3, seed=9, collate_fn=list)
    for epoch in (0, 1):
        for batch in loader:
            for index, initial, drawn in (t.tolist() for t in batch):
                key = derive_seed(9, "sample", epoch, int(index))
                assert initial == float(key)
                assert drawn == float(np.random.default_rng(key).integers(2**62))


def test_globals_are_seeded_as_by_the_public_calls() -> None:
    """The fast per-sample seeding leaves the state random.seed / np.random.seed / manual_seed give."""
    loader = SeededLoader(Draws(5, use_sample_rng=False), batch_size=5, seed=4, shuffle=False)
    (batch,) = list(loader)
    for index, py, npy, th in batch.tolist():
        key = derive_seed(4, "sample", 0, int(index))
        assert py == random.Random(key).random()
        assert npy == np.random.RandomState(key >> 32).rand()
        assert th == float(torch.rand((), generator=torch.Generator().manual_seed(key)))


def test_collate_is_keyed_by_batch(rng_changes_ok: None) -> None:
    batches = list(SeededLoader(Draws(8), batch_size=4, seed=2, collate_fn=collate_with_draw))
    for b, batch in enumerate(batches):
        torch.default_generator.manual_seed(derive_seed(2, "batch", 0, b))
        expected = torch.rand(4, 1, dtype=torch.float64)
        assert torch.equal(batch[:, -1:], expected)


def test_sample_rng_outside_a_loader_raises() -> None:
    with pytest.raises(ReproError, match="outside a sample being loaded by a SeededLoader"):
        sample_rng()


def test_dataset_with_getitems_is_seeded_per_batch() -> None:
    a, b = (passes(SeededLoader(Batched(), batch_size=4, seed=0, num_workers=w)) for w in (0, 2))
    assert same(a, b)
    assert len({x[1].item() for batch in a for x in batch}) == 40
