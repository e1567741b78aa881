"""The SeededLoader's sampler: order a pure function of (seed, epoch), rank shards, a
DistributedSampler that reads rank and world size when each pass starts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dataloading import order

from helpers import free_port
from torchrepro import SeededLoader
from torchrepro.data import LoaderConfigError

# -- order, epochs, shards -------------------------------------------------------------------------


def test_order_is_a_pure_function_of_seed_and_epoch(rng_changes_ok: None) -> None:
    a = SeededLoader(list(range(50)), batch_size=8, seed=5)
    first = order(a)
    torch.manual_seed(123)  # the global RNG does not matter
    b = SeededLoader(list(range(50)), batch_size=8, seed=5)
    assert order(b) == first
    assert a.epoch == b.epoch == 0
    second = order(a)  # each new pass is the next epoch
    assert a.epoch == 1 and second != first and sorted(second) == list(range(50))
    c = SeededLoader(list(range(50)), batch_size=8, seed=5)
    c.set_epoch(1)
    assert order(c) == second
    assert order(SeededLoader(list(range(50)), batch_size=8, seed=6)) != first
    assert order(SeededLoader(list(range(50)), batch_size=8, seed=5, shuffle=False)) == list(range(50))


@pytest.mark.parametrize(
    ("n", "world_size", "drop_last"), [(12, 3, False), (10, 3, False), (10, 3, True), (2, 4, False)]
)
def test_rank_shards_are_disjoint_and_cover_the_dataset(n: int, world_size: int, drop_last: bool) -> None:
    for epoch in (0, 1):
        shards = []
        for rank in range(world_size):
            loader = SeededLoader(
                list(range(n)), batch_size=1, seed=0, rank=rank, world_size=world_size, drop_last=drop_last
            )
            loader.set_epoch(epoch)
            shards.append(order(loader))
        sizes = {len(s) for s in shards}
        assert len(sizes) == 1  # every rank gets as many samples (and batches)
        flat = [i for s in shards for i in s]
        if drop_last:  # the uneven tail is dropped: disjoint, all but n % world_size covered
            assert len(set(flat)) == len(flat) == n - n % world_size
        else:  # padded with the first indices: covering, only the padding repeats
            assert set(flat) == set(range(n))
            assert len(flat) - len(set(flat)) == -n % world_size


def test_rank_and_world_size_come_from_torch_distributed() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        state = SeededLoader(list(range(10)), batch_size=2, seed=0).state_dict()
        assert (state["rank"], state["world_size"]) == (0, 1)
    finally:
        dist.destroy_process_group()


def test_the_sampler_is_a_distributed_sampler_read_at_each_pass() -> None:
    from torch.utils.data.distributed import DistributedSampler

    loader = SeededLoader(list(range(10)), batch_size=2, seed=0)
    sampler: Any = loader.sampler
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.rank, sampler.num_replicas, sampler.num_samples, sampler.shuffle) == (0, 1, 10, True)
    fixed: Any = SeededLoader(list(range(10)), batch_size=2, seed=0, rank=1, world_size=3).sampler
    assert (fixed.rank, fixed.num_replicas, fixed.num_samples, fixed.total_size) == (1, 3, 4, 12)
    with pytest.raises(LoaderConfigError, match=r"use_distributed_sampler=False"):
        SeededLoader(list(range(10)), batch_size=2, seed=0, sampler=DistributedSampler(range(10), 1, 0))
