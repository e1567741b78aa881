"""SeededLoader over a ShardedDataset: one global sequence for any num_workers and world size.

Generated shards of 5-50 samples (one empty), read by an augmenting ``read_shard`` that draws
from the global torch RNG, NumPy's global RNG and ``sample_rng()``. Exhaustive where the space
is small: num_workers in {0, 1, 2, 3} x world size in {1, 2, 4} give the same sequence of
(sample id, draws); a resume at every batch of a 2-epoch run, onto other worker counts and world
sizes, continues it. Negative controls: a plain DataLoader over the same dataset changes with
num_workers, and per-worker stream positions cannot resume on another worker count.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import torchrepro
from torchrepro import DataLoaderStateError, LoaderConfigError, ShardReadError, UnsupportedDatasetError

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers, 2 cores

LENGTHS = [7, 23, 5, 0, 50, 12, 31, 9]  # unequal, one empty
TOTAL = sum(LENGTHS)
BATCH = 4


def read_shard(shard: int):
    for offset in range(LENGTHS[shard]):
        yield {
            "id": shard * 1000 + offset,
            "torch": torch.rand(()).item(),
            "numpy": float(np.random.rand()),
            "python": random.random(),
            "keyed": float(torchrepro.sample_rng().random()),
        }


class Counted:
    """read_shard(shard, start): records which samples were read (in the main process)."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []

    def __call__(self, shard: int, start: int = 0):
        for offset in range(start, LENGTHS[shard]):
            self.reads.append((shard, offset))
            yield {"id": shard * 1000 + offset, "torch": torch.rand(()).item()}


def as_rows(batch: dict[str, Any]) -> list[tuple]:
    return [tuple(float(batch[k][i]) for k in sorted(batch)) for i in range(len(batch["id"]))]


def loader(ds: Any = None, *, rank: int = 0, world: int = 1, **kwargs) -> torchrepro.SeededLoader:
    kwargs.setdefault("shuffle_buffer", 16)
    return torchrepro.SeededLoader(
        ds if ds is not None else torchrepro.ShardedDataset(range(len(LENGTHS)), read_shard),
        batch_size=BATCH, seed=7, rank=rank, world_size=world, **kwargs,
    )  # fmt: skip


def global_sequence(world: int, epochs: int = 1, **kwargs) -> list[list[tuple]]:
    """Every rank's batches of each epoch, put back in global order (step by step)."""
    per_rank = []
    for rank in range(world):
        ld = loader(rank=rank, world=world, **kwargs)
        per_rank.append([as_rows(b) for _ in range(epochs) for b in ld])
    steps = [list(step) for step in zip(*per_rank, strict=True)]
    return [rows for step in steps for rows in step]


@pytest.fixture(scope="module")
def reference() -> list[list[tuple]]:
    return global_sequence(1, epochs=2)


def flat(batches: list[list[tuple]]) -> list[tuple]:
    return [row for batch in batches for row in batch]


def test_every_worker_count_and_world_size_gives_the_one_sequence(reference: list) -> None:
    one_epoch = flat(global_sequence(1))
    assert sorted(row[0] for row in one_epoch) == sorted(
        s * 1000 + o for s, n in enumerate(LENGTHS) for o in range(n)
    )
    assert one_epoch != sorted(one_epoch, key=lambda r: r[0])  # shuffled
    for workers in (0, 1, 2, 3):
        for world in (1, 2, 4):
            seq = flat(global_sequence(world, num_workers=workers))
            usable = TOTAL // (BATCH * world) * BATCH * world  # whole steps; the last one is padded
            assert seq[:usable] == one_epoch[:usable], (workers, world)
    assert flat(reference)[:TOTAL] == one_epoch
    assert flat(reference)[TOTAL:] != one_epoch  # the next epoch is another order and other draws


def test_persistent_workers_change_nothing(reference: list) -> None:
    ld = loader(num_workers=2, persistent_workers=True)
    assert [as_rows(b) for _ in range(2) for b in ld] == reference


def test_resume_at_every_batch_onto_other_worker_counts_and_world_sizes(reference: list) -> None:
    """Saved after every batch of a 2-epoch run (1 process), loaded into a fresh loader with
    another num_workers: the rest of the run is the rest of the uninterrupted one; loaded on 2
    ranks (every position a 2-rank step divides): the rest of that epoch is the same sequence."""
    per_epoch = len(reference) // 2
    for k in range(len(reference) + 1):
        epoch, within = divmod(k, per_epoch)
        if epoch == 2:  # after the last batch of the second epoch, inside its pass
            epoch, within = 1, per_epoch
        saver = loader()
        if epoch == 1:
            list(saver)  # the whole first epoch: its pass ended
        it = iter(saver)
        for _ in range(within):
            next(it)
        state = saver.state_dict()
        assert [key for key, v in state.items() if isinstance(v, list)] == ["shard_lengths"]  # not the buffer
        resumed = loader(num_workers=(0, 1, 2, 3)[k % 4] if k % 5 == 0 else 0)
        resumed.load_state_dict(state)
        rest = [as_rows(b) for b in resumed]
        if epoch == 0:
            rest += [as_rows(b) for b in resumed]  # and the next epoch
        assert rest == reference[k:], k
        if within % 2 == 0:
            ranks = []
            for rank in (0, 1):
                r = loader(rank=rank, world=2)
                r.load_state_dict(state)
                ranks.append([as_rows(b) for b in r])
            merged = flat([rows for step in zip(*ranks, strict=True) for rows in step])
            usable = (TOTAL - within * BATCH) // (2 * BATCH) * 2 * BATCH
            expected = flat(reference[epoch * per_epoch + within : (epoch + 1) * per_epoch])
            assert merged[:usable] == expected[:usable], k


def test_a_resume_reads_only_the_shards_still_holding_samples() -> None:
    counted = Counted()
    ds = torchrepro.ShardedDataset(range(len(LENGTHS)), counted)
    full = [as_rows(b) for b in loader(ds, shuffle_buffer=8)]
    saver = loader(ds, shuffle_buffer=8)
    it = iter(saver)
    for _ in range(20):
        next(it)
    state = saver.state_dict()
    counted.reads.clear()
    resumed = loader(ds, shuffle_buffer=8)
    resumed.load_state_dict(state)
    assert [as_rows(b) for b in resumed] == full[20:]
    read_shards = {s for s, _ in counted.reads}
    order = saver._shard_order(0)
    consumed_shards = order[: order.index(min(read_shards, key=order.index))]
    assert consumed_shards, "the resume should skip the shards whose samples were all delivered"
    assert not read_shards & set(consumed_shards)
    assert len(counted.reads) < TOTAL - 20 * BATCH + 8 + max(LENGTHS)  # the rest, the buffer, one shard


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_parts_the_framework_integrations_use(drop_last: bool) -> None:
    """``_state`` (a position the loop is at, behind the loader's), ``_rest_is_empty`` (a restored
    position with nothing left in its epoch), and a sampler frameworks keep under DDP."""
    from torch.utils.data.distributed import DistributedSampler

    ld = loader(drop_last=drop_last)
    assert isinstance(ld.sampler, DistributedSampler)
    assert (ld.sampler.rank, ld.sampler.num_replicas) == (0, 1)
    batches = list(ld)  # 35 batches (the last one 1 sample), or 34 with drop_last
    end = ld.state_dict()
    assert (end["batches_consumed"], end["finished"]) == (len(batches), True)
    behind = ld._state(len(batches) - 1, finished=False)
    assert {k: v for k, v in behind.items() if end[k] != v} == {
        "batches_consumed": len(batches) - 1,
        "samples_consumed": (len(batches) - 1) * BATCH,
        "finished": False,
    }
    for position, empty in ((behind, False), ({**end, "finished": False}, True), (end, False)):
        resumed = loader(drop_last=drop_last)
        resumed.load_state_dict(position)
        assert resumed._rest_is_empty() is empty
        assert (len(list(resumed)) == 0) is empty
    fresh = loader(drop_last=drop_last)
    assert not fresh._rest_is_empty()


def read_plain(shard: int):
    for offset in range(LENGTHS[shard]):
        yield {"id": shard * 1000 + offset, "torch": torch.rand(()).item()}


@pytest.mark.usefixtures("rng_changes_ok")
def test_negative_control_a_plain_dataloader_depends_on_num_workers() -> None:
    ds = torchrepro.ShardedDataset(range(len(LENGTHS)), read_plain)
    seqs = []
    for workers in (1, 2):
        torch.manual_seed(0)
        seqs.append([as_rows(b) for b in DataLoader(ds, batch_size=BATCH, num_workers=workers)])
    assert flat(seqs[0]) != flat(seqs[1])
    assert sorted(r[0] for r in flat(seqs[0])) == sorted(r[0] for r in flat(seqs[1]))  # same samples


class PerWorkerState(IterableDataset):
    """What per-worker stream state (StatefulDataLoader-style) looks like: each worker reads
    every num_workers-th shard and its state is how many samples it yielded."""

    def __init__(self, skip: dict[int, int] | None = None) -> None:
        self.skip = skip or {}

    def __iter__(self):
        info = get_worker_info()
        wid, n = (0, 1) if info is None else (info.id, info.num_workers)
        count = 0
        for shard in range(wid, len(LENGTHS), n):
            for offset in range(LENGTHS[shard]):
                count += 1
                if count > self.skip.get(wid, 0):
                    yield shard * 1000 + offset


@pytest.mark.usefixtures("rng_changes_ok")
def test_negative_control_per_worker_state_cannot_resume_on_another_worker_count() -> None:
    whole = [x for b in DataLoader(PerWorkerState(), batch_size=BATCH, num_workers=2) for x in b.tolist()]
    delivered = whole[: 10 * BATCH]
    per_worker = {0: 0, 1: 0}
    for i in range(10):  # batches alternate between the two workers
        per_worker[i % 2] += BATCH
    same = DataLoader(PerWorkerState(per_worker), batch_size=BATCH, num_workers=2)
    assert delivered + [x for b in same for x in b.tolist()] == whole  # resumes on 2 workers
    other = DataLoader(PerWorkerState(per_worker), batch_size=BATCH, num_workers=3)
    rest = [x for b in other for x in b.tolist()]
    assert sorted(delivered + rest) != sorted(whole)  # on 3 workers samples are lost or repeated


def test_drop_last_and_the_padded_last_step() -> None:
    kept = flat([as_rows(b) for b in loader(drop_last=True)])
    assert len(kept) == TOTAL // BATCH * BATCH
    two = [[as_rows(b) for b in loader(rank=r, world=2)] for r in (0, 1)]
    assert len(two[0]) == len(two[1])  # the ranks see as many batches (the last step padded)


def test_global_batches_are_micro_batch_blocks_of_the_sequence() -> None:
    one = flat([as_rows(b) for b in loader(global_batch_size=16, drop_last=True)])
    for world in (2, 4):
        per_rank = [
            [as_rows(b) for b in loader(rank=r, world=world, global_batch_size=16, drop_last=True)]
            for r in range(world)
        ]
        a = 4 // world
        merged = []
        for g in range(len(per_rank[0]) // a):
            for r in range(world):
                merged += flat(per_rank[r][g * a : (g + 1) * a])
        assert merged == one
    with pytest.raises(LoaderConfigError, match="drop_last=True with global_batch_size"):
        loader(global_batch_size=16)


def test_errors_name_what_is_wrong() -> None:
    def broken(shard: int):
        if shard == 2:
            raise FileNotFoundError(f"no such file: shard-{shard}.jsonl")
        yield from read_shard(shard)

    ds = torchrepro.ShardedDataset(range(len(LENGTHS)), broken)
    for workers in (0, 2):
        with pytest.raises(
            Exception, match=r"Shard 2 \(2\) failed while .*FileNotFoundError: no such file: shard-2"
        ):
            list(loader(ds, num_workers=workers, shuffle=False, shuffle_buffer=1))

    class Stream(IterableDataset):
        def __iter__(self):
            yield 1

    with pytest.raises(UnsupportedDatasetError, match=r"ShardedDataset\(shards, read_shard\)"):
        torchrepro.SeededLoader(Stream(), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="no shards"):
        torchrepro.ShardedDataset([], read_shard)
    with pytest.raises(TypeError, match="list of shards"):
        torchrepro.ShardedDataset("data/*.jsonl", read_shard)
    with pytest.raises(LoaderConfigError, match="shuffle_buffer= is for streamed data"):
        torchrepro.SeededLoader(list(range(8)), batch_size=2, seed=0, shuffle_buffer=4)
    with pytest.raises(LoaderConfigError, match="shuffle=False keeps the stream's order"):
        loader(shuffle=False, shuffle_buffer=4)
    with pytest.raises(TypeError, match="no length"):
        len(loader())
    saver = loader(rank=0, world=2)
    it = iter(saver)
    next(it)
    with pytest.raises(DataLoaderStateError, match="Resume on 2 processes"):
        loader(rank=0, world=4).load_state_dict(saver.state_dict())
    with pytest.raises(DataLoaderStateError, match="shuffle_buffer: state has 16, this loader has 8"):
        loader(shuffle_buffer=8).load_state_dict(loader().state_dict())
    assert isinstance(ShardReadError("x"), torchrepro.ReproError)


def test_hugging_face_streaming_shards() -> None:
    datasets = pytest.importorskip("datasets")  # a pinned test dependency: present in make test
    data = datasets.Dataset.from_dict({"x": list(range(60)), "y": [float(i) / 7 for i in range(60)]})
    stream = data.to_iterable_dataset(num_shards=8)
    ds = torchrepro.ShardedDataset.from_hf(stream)
    assert ds.num_shards == 8
    seqs = [
        [
            b["x"].tolist()
            for b in torchrepro.SeededLoader(ds, batch_size=4, seed=0, shuffle_buffer=10, num_workers=w)
        ]
        for w in (0, 2)
    ]
    assert seqs[0] == seqs[1]
    assert sorted(x for batch in seqs[0] for x in batch) == list(range(60))
    with pytest.raises(TypeError, match=r"datasets\.IterableDataset"):
        torchrepro.ShardedDataset.from_hf(data)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_torchrun_ranks_with_workers_stream_the_one_sequence(tmp_path: Path, world: int) -> None:
    """Real torchrun (gloo), 2 workers per rank: the ranks' batches, in step order, are the
    1-process sequence; a state saved by 1 process mid-epoch resumes on every rank."""
    script = Path(__file__).parent / "stream_scripts" / "ranks.py"
    spec = importlib.util.spec_from_file_location("stream_ranks", script)
    assert spec is not None and spec.loader is not None
    ranks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ranks)
    one = [ranks.rows(b) for b in ranks.loader()]
    saver = ranks.loader()
    it = iter(saver)
    for _ in range(2 * world):  # two steps of `world` ranks
        next(it)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(saver.state_dict()))
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    proc = subprocess.run(
        [*cmd, str(script), str(out), str(state)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    usable = sum(len(b) for b in one) // (4 * world) * 4 * world
    for key, skip in (("whole", 0), ("rest", 2 * world)):
        merged = [row for step in zip(*result[key], strict=True) for batch in step for row in batch]
        expected = [row for batch in one[skip:] for row in batch]
        assert merged[: usable - skip * 4] == expected[: usable - skip * 4], key


@pytest.mark.usefixtures("rng_changes_ok")  # read() seeds the globals (its callers put them back)
def test_what_a_process_learned_about_the_rngs_changes_no_sample() -> None:
    """Python's and NumPy's RNGs are seeded per sample only once a shard was seen drawing from
    them (the shard is then read again); a process that learned it and one that seeds all three
    per sample from the start read the same samples."""

    def numpy_only(shard: int):
        for offset in range(LENGTHS[shard]):
            yield {
                "id": shard * 1000 + offset,
                "numpy": float(np.random.rand()),
                "torch": torch.rand(()).item(),
            }

    learning = torchrepro.ShardedDataset(range(len(LENGTHS)), numpy_only)
    seeding_all = torchrepro.ShardedDataset(range(len(LENGTHS)), numpy_only)
    reads = [learning.read(7, 0, shard, 0) for shard in range(len(LENGTHS))]
    from torchrepro.seeding import NUMPY_RNG, PYTHON_RNG

    assert learning._tr_watch.drawn == NUMPY_RNG  # learned: NumPy drawn from, Python never
    seeding_all.read(7, 0, 0, 0)
    seeding_all._tr_watch.drawn = NUMPY_RNG | PYTHON_RNG
    assert [seeding_all.read(7, 0, shard, 0) for shard in range(len(LENGTHS))] == reads
