"""SeededLoader(global_batch_size=...): each rank's micro-batches of every global batch.

Exhaustive over the world sizes dividing V = 12: the ranks' blocks, put back in global order, are
the 1-process sequence (samples, augmentation draws and collate seeds); every boundary position
resumes on every other world size with the rest of the epoch; positions inside a global batch are
refused on another world size.
"""

from __future__ import annotations

import pytest
import torch

import torchrepro
from torchrepro import DataLoaderStateError, LoaderConfigError

V, MICRO = 12, 2
GLOBAL = V * MICRO
WORLDS = [1, 2, 3, 4, 6, 12]


class Drawing(torch.utils.data.Dataset):
    """Each sample is (index, a draw of the global torch RNG, seeded per sample by the loader)."""

    def __len__(self) -> int:
        return 2 * GLOBAL

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item()])


def collate_with_draw(samples: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.stack(samples).flatten(), torch.rand(1)])  # collate draws too


def loader(rank: int, world: int, **kwargs) -> torchrepro.SeededLoader:
    return torchrepro.SeededLoader(
        Drawing(), batch_size=MICRO, global_batch_size=GLOBAL, seed=3, rank=rank, world_size=world,
        collate_fn=collate_with_draw, **kwargs,
    )  # fmt: skip


def global_sequence(world: int, epoch: int = 0, **kwargs) -> list[list[float]]:
    per_rank = []
    for rank in range(world):
        ld = loader(rank, world, **kwargs)
        assert ld.accumulation_steps == V // world and ld.micro_batches == V
        ld.set_epoch(epoch)
        per_rank.append([b.tolist() for b in ld])
    a = V // world
    out = []
    for g in range(len(per_rank[0]) // a):
        for rank in range(world):
            out += per_rank[rank][g * a : (g + 1) * a]
    return out


def test_every_world_size_sees_the_one_global_sequence() -> None:
    reference = global_sequence(1)
    assert len(reference) == 2 * V
    for world in WORLDS[1:]:
        assert global_sequence(world) == reference, world
    assert global_sequence(2, epoch=1) != reference  # the epoch decides the order


def test_worker_processes_change_nothing() -> None:
    assert global_sequence(2, num_workers=2) == global_sequence(1)


def test_negative_control_a_plain_distributed_split_is_another_sequence() -> None:
    """Without global batches, rank r of 2 takes every other sample: the micro-batches differ."""
    plain = [
        torchrepro.SeededLoader(
            Drawing(), batch_size=MICRO, seed=3, rank=r, world_size=2, collate_fn=collate_with_draw
        )
        for r in (0, 1)
    ]
    interleaved = [b.tolist() for pair in zip(*plain, strict=True) for b in pair]
    assert interleaved != global_sequence(1)


def test_a_world_size_that_does_not_divide_v_is_refused_naming_those_that_do() -> None:
    with pytest.raises(LoaderConfigError, match=r"World sizes that work: 1, 2, 3, 4, 6, 12"):
        loader(0, 5).accumulation_steps  # noqa: B018
    with pytest.raises(LoaderConfigError, match=r"World sizes that work"):
        next(iter(loader(0, 5)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch_size": 25}, r"not a multiple of batch_size=2.*global_batch_size=24 or 26"),
        (
            {"global_batch_size": 20},
            r"48 samples are not a whole number of global batches of 20.*drop_last=True",
        ),
        ({"global_batch_size": 50, "drop_last": True}, r"fewer than one global batch"),
    ],
)
def test_global_batch_arguments_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(LoaderConfigError, match=message):
        torchrepro.SeededLoader(Drawing(), batch_size=MICRO, seed=3, **kwargs)
    with pytest.raises(ValueError, match="positive int"):
        torchrepro.SeededLoader(Drawing(), batch_size=MICRO, seed=3, global_batch_size=0)


def test_drop_last_drops_the_incomplete_global_batch() -> None:
    ld = torchrepro.SeededLoader(Drawing(), batch_size=MICRO, seed=3, global_batch_size=20, drop_last=True)
    assert len(ld) == 20 // MICRO * (48 // 20) and sum(1 for _ in ld) == len(ld)


def test_every_boundary_resumes_on_every_world_size() -> None:
    """Saved after each whole global batch (2 per epoch, over 2 epochs) by every world size, and
    loaded by every other: the rest of the run is the rest of the 1-process sequence."""
    sequence = global_sequence(1) + global_sequence(1, epoch=1)
    for saved_world in WORLDS:
        a = V // saved_world
        for boundary in range(4):  # whole global batches received
            epoch, within = divmod(boundary, 2)
            saver = loader(0, saved_world)
            saver.set_epoch(epoch)
            it = iter(saver)
            for _ in range(within * a):
                next(it)
            state = saver.state_dict()
            for world in WORLDS:
                rest = []
                for rank in range(world):
                    ld = loader(rank, world)
                    ld.load_state_dict(state)
                    ld.set_epoch(epoch)
                    rest.append([b.tolist() for b in ld])
                    if epoch == 0:
                        ld.set_epoch(1)
                        rest[-1] += [b.tolist() for b in ld]
                b = V // world
                merged = []
                for g in range(len(rest[0]) // b):
                    for rank in range(world):
                        merged += rest[rank][g * b : (g + 1) * b]
                assert merged == sequence[boundary * V :], (saved_world, boundary, world)


def test_a_position_inside_a_global_batch_resumes_only_on_its_own_world_size() -> None:
    saver = loader(1, 3)
    it = iter(saver)
    next(it)
    state = saver.state_dict()
    with pytest.raises(DataLoaderStateError, match=r"1 micro-batches into global batch 0.*Resume on 3"):
        loader(0, 2).load_state_dict(state)
    same = loader(1, 3)
    same.load_state_dict(state)
    assert next(b.tolist() for b in same) == next(b.tolist() for b in it)


def test_a_state_without_global_batches_does_not_load_into_one_with() -> None:
    plain = torchrepro.SeededLoader(Drawing(), batch_size=MICRO, seed=3)
    with pytest.raises(DataLoaderStateError, match=r"global_batch_size: state has None, this loader has 24"):
        loader(0, 1).load_state_dict(plain.state_dict())
