"""``accelerator.prepare(seeded_loader)`` keeps the SeededLoader's batches (one process).

accelerate rebuilds the loader from its parts (``dataset``, ``batch_sampler``, ``collate_fn``,
``num_workers``, ``generator``...) into a ``DataLoaderShard``, which iterates one batch ahead and
calls ``set_epoch`` before each pass; ``skip_first_batches`` rebuilds it again around a
``SkipBatchSampler``. The negative control: a plain ``DataLoader`` whose dataset draws a random
augmentation gives other batches with 2 workers than with 0 after the same ``prepare``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator, skip_first_batches

import torchrepro


class Augmented(torch.utils.data.Dataset[torch.Tensor]):
    """A random augmentation from the global torch RNG; counts the samples it loads."""

    def __init__(self, n: int = 22) -> None:
        self.x = torch.arange(n, dtype=torch.float64)
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loaded += 1
        return torch.stack([self.x[i], torch.rand((), dtype=torch.float64)])


@pytest.fixture(scope="module")
def accelerator() -> Accelerator:
    return Accelerator(cpu=True)


def _epochs(loader: Any, n: int = 2) -> list[list[torch.Tensor]]:
    return [list(loader) for _ in range(n)]


def _equal(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


def _seeded(workers: int, dataset: Augmented | None = None) -> torchrepro.SeededLoader:
    return torchrepro.SeededLoader(dataset or Augmented(), batch_size=4, seed=3, num_workers=workers)


@pytest.fixture(scope="module")
def reference() -> list[list[torch.Tensor]]:
    """Two epochs of the SeededLoader itself (6 batches each, the last of 2 samples)."""
    return _epochs(_seeded(0))


@pytest.mark.parametrize("workers", [0, 2])
def test_prepare_keeps_the_seeded_loaders_batches(
    accelerator: Accelerator, reference: list[list[torch.Tensor]], workers: int
) -> None:
    prepared = accelerator.prepare(_seeded(workers))
    assert len(prepared) == 6
    assert _equal(_epochs(prepared), reference)


def test_prepare_keeps_set_epoch(accelerator: Accelerator, reference: list[list[torch.Tensor]]) -> None:
    prepared = accelerator.prepare(_seeded(0))
    prepared.set_epoch(1)
    assert _equal([list(prepared)], reference[1:])


@pytest.mark.parametrize("epoch", [0, 1])
def test_skip_first_batches_skips_by_index(
    accelerator: Accelerator, reference: list[list[torch.Tensor]], epoch: int
) -> None:
    dataset = Augmented()
    prepared = accelerator.prepare(_seeded(0, dataset))
    skipping = skip_first_batches(prepared, 4)
    skipping.set_epoch(epoch)
    assert _equal([list(skipping)], [reference[epoch][4:]])
    assert dataset.loaded == 6  # the two batches after the skipped ones: nothing skipped was loaded


@pytest.mark.parametrize("workers", [0, 2])
def test_the_seeded_loader_itself_is_unchanged_by_prepare(
    accelerator: Accelerator, reference: list[list[torch.Tensor]], workers: int
) -> None:
    loader = _seeded(workers)
    accelerator.prepare(loader)
    assert _equal(_epochs(loader), reference)


def test_negative_control_plain_loader_differs_between_worker_counts(
    accelerator: Accelerator, rng_changes_ok: None
) -> None:
    def plain(workers: int) -> list[list[torch.Tensor]]:
        torch.manual_seed(0)
        loader = torch.utils.data.DataLoader(
            Augmented(),
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(3),
        )
        return _epochs(accelerator.prepare(loader))

    zero, two = plain(0), plain(2)
    assert _equal(zero, plain(0))  # the same setting repeats: the difference is the workers
    assert not _equal(zero, two)
