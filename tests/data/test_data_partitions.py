"""Partitioned streams: ``SeededLoader(..., partitions=P)``, ``filter``, ``pack`` and ``mix``.

The datasets (filtered; filtered and packed; a weighted mix of a filtered and a plain source) come
from ``stream_scripts/partitions.py``: unequal shards, one empty, documents of random length
(some empty), a filter drawing from ``sample_rng()``. Exhaustive where the space is small:
num_workers in {0, 1, 2, 3} x world size in {1, 2, 4} give the one-process global batches; a
resume at every global-batch boundary of a two-epoch run, onto other worker counts and world
sizes, continues them. Real torchrun (gloo) on 2 and 4 processes: each rank reads only its own
partitions' shards, every shard once an epoch, and the ranks' micro-batches are the one-process
global batches; every state rank 0 saved resumes on one process. Negative controls: a plain
DataLoader over the same filtered, packed or mixed dataset changes with num_workers, and so does
a Hugging Face stream split by rank (``split_dataset_by_node``) with the world size.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import torchrepro
from torchrepro import DataLoaderStateError, LoaderConfigError, ShardReadError

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers, 2 cores

_SCRIPT = Path(__file__).parent / "stream_scripts" / "partitions.py"
_spec = importlib.util.spec_from_file_location("stream_partitions", _SCRIPT)
assert _spec is not None and _spec.loader is not None
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

DATASETS = script.datasets()
V = script.GLOBAL // script.BATCH


def global_batches(name: str, world: int, num_workers: int, epochs: int = 2, state: Any = None) -> list[Any]:
    """The global batches of ``epochs`` passes, from ``world`` simulated ranks (``rank=``)."""
    loaders = [
        script.loader(DATASETS[name], num_workers=num_workers, rank=r, world_size=world) for r in range(world)
    ]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    return merge([[b for _ in range(epochs) for b in loader] for loader in loaders])


def merge(per_rank: list[list[Any]]) -> list[Any]:
    """Global batches from each rank's micro-batches (each rank's block of every global batch)."""
    a = V // len(per_rank)
    steps = len(per_rank[0]) // a
    assert all(len(batches) == steps * a for batches in per_rank)
    return [[mb for batches in per_rank for mb in batches[s * a : (s + 1) * a]] for s in range(steps)]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[Any]]:
    return {name: global_batches(name, 1, 0) for name in DATASETS}


def states_at_boundaries(name: str, world: int, num_workers: int = 0) -> list[dict[str, Any]]:
    """Rank 0's state before the first global batch and after each one, over two epochs."""
    loader = script.loader(DATASETS[name], num_workers=num_workers, rank=0, world_size=world)
    states = [loader.state_dict()]
    for _ in range(2):
        for i, _batch in enumerate(loader, 1):
            if i % loader.accumulation_steps == 0:
                states.append(json.loads(json.dumps(loader.state_dict())))  # as a checkpoint holds it
    return states


def assert_resumes(
    name: str, states: list[dict[str, Any]], ref: list[Any], shapes: list[tuple[int, int]]
) -> None:
    """Each state, resumed for two passes on the next of ``shapes``, continues ``ref``."""
    assert len(states) == len(ref) + 1
    for k, state in enumerate(states[:-1]):
        shape = shapes[k % len(shapes)]
        passes = 2 if state["epoch"] == 0 else 1  # the rest of epoch 0 (maybe empty) and epoch 1
        assert global_batches(name, *shape, epochs=passes, state=state)[: len(ref) - k] == ref[k:], (
            name,
            k,
            shape,
        )


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_every_worker_count_and_world_size_gives_the_one_process_batches(
    name: str, reference: dict[str, list[Any]]
) -> None:
    first = global_batches(name, 1, 0, epochs=1)
    assert len(first) >= 4 and reference[name][: len(first)] == first
    for world in (1, 2, 4):  # every worker count for the packed stream, 0 and 2 for the others
        for num_workers in (0, 1, 2, 3) if name == "packed" else (0, 2):
            if (world, num_workers) != (1, 0):
                assert global_batches(name, world, num_workers, epochs=1) == first, (world, num_workers)


@pytest.mark.parametrize("packed", [False, True], ids=["samples", "packed"])
def test_a_read_shard_that_opens_at_an_offset_resumes_at_every_boundary(packed: bool) -> None:
    """With ``read_shard(shard, start)`` an unfiltered shard is opened at the sample a resume
    needs (a packed one from its start: a block begins at a token, not at a document); a resume at
    every global-batch boundary onto 4 ranks continues the one-process run."""
    ds = torchrepro.ShardedDataset(range(len(script.LENGTHS)), script.read_doc_from)
    ds = ds.pack(6) if packed else ds
    whole = script.loader(ds, shuffle_buffer=3)
    ref = [mb for _ in range(2) for mb in whole]  # two epochs
    saver = script.loader(ds, shuffle_buffer=3)
    it = iter(saver)
    done = 0
    for k in range(len(ref) // V):
        state = json.loads(json.dumps(saver.state_dict()))
        resumed = [script.loader(ds, shuffle_buffer=3, rank=r, world_size=4) for r in range(4)]
        for each in resumed:
            each.load_state_dict(state)
        rest = [[b for _ in range(2 if state["epoch"] == 0 else 1) for b in each] for each in resumed]
        assert [mb for s in range(len(rest[0])) for r in rest for mb in r[s : s + 1]][
            : len(ref) - done
        ] == ref[done:], k
        for _ in range(V):
            try:
                next(it)
            except StopIteration:
                it = iter(saver)
                next(it)
            done += 1


def test_persistent_workers_keep_the_batches_across_epochs(reference: dict[str, list[Any]]) -> None:
    """Persistent workers outlive a pass that ended with shards still in flight (the epoch ends at
    the first partition that runs out): the next epochs are unchanged."""
    stream = script.loader(DATASETS["mixed"], num_workers=2, persistent_workers=True, prefetch_factor=3)
    assert [b for _ in range(2) for b in stream] == [mb for step in reference["mixed"] for mb in step]


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_resume_at_every_global_batch_boundary_onto_other_shapes(
    name: str, reference: dict[str, list[Any]]
) -> None:
    """A state saved by rank 0 of 2 after each global batch of two epochs (the end of the first
    included) resumes on 1 and 4 processes, and on 2 with 3 workers: the rest of the run."""
    assert_resumes(name, states_at_boundaries(name, 2), reference[name], [(4, 0), (1, 0), (4, 0), (2, 3)])


@pytest.mark.parametrize("name", ["filtered", "packed"])
def test_a_resume_reads_only_from_the_first_shard_still_buffered(
    tmp_path: Path, monkeypatch, name: str
) -> None:
    """Without a shuffle buffer to refill, a resume 3/4 into the epoch reads only the shards from
    each stream's position on (filtered: re-read from their start), not the epoch again."""
    monkeypatch.setattr(script, "READS", str(tmp_path))
    batches = list(script.loader(DATASETS[name], shuffle_buffer=1))
    whole = sum(reads(tmp_path).values())
    saver = script.loader(DATASETS[name], shuffle_buffer=1)
    it = iter(saver)
    for _ in range(len(batches) * 3 // 4):
        next(it)
    state = saver.state_dict()
    for f in tmp_path.iterdir():
        f.unlink()
    resumed = script.loader(DATASETS[name], shuffle_buffer=1)
    resumed.load_state_dict(state)
    assert list(resumed) == batches[len(batches) * 3 // 4 :]
    assert 0 < sum(reads(tmp_path).values()) < whole * 0.8, (reads(tmp_path), whole)  # reading it all: >= 1


def reads(directory: Path, rank: int | None = None) -> Counter[int]:
    """Samples read per shard, from the notes the readers leave (of one rank's processes)."""
    counted: Counter[int] = Counter()
    for f in directory.iterdir():
        if f.name.startswith("rank") and (rank is None or f.name.startswith(f"rank{rank}-")):
            for line in f.read_text().split("\n"):
                if line:
                    shard, n = map(int, line.split())
                    counted[shard] += n
    return counted


@functools.cache
def trained_alone() -> list[float]:
    return script.train(DATASETS["packed"])


@pytest.mark.slow
@pytest.mark.parametrize("world,num_workers", [(2, 2), (4, 0)])
def test_torchrun_ranks_read_only_their_partitions(
    tmp_path: Path,
    monkeypatch,
    world: int,
    num_workers: int,
    reference: dict[str, list[Any]],
    rng_changes_ok: None,
) -> None:
    """Real torchrun (gloo): the ranks' micro-batches are the one-process global batches, and a
    model trained on them under InvariantDataParallel ends with one process's weights; all ranks
    together read about what one process reads (each about 1/W of it), where every rank would
    read all of it without partitions; every state rank 0 saved resumes on one process."""
    alone = tmp_path / "alone"
    alone.mkdir()
    monkeypatch.setattr(script, "READS", str(alone))
    for name in DATASETS:
        loader = script.loader(DATASETS[name])
        for _ in range(2):
            for _batch in loader:
                pass
    one = reads(alone)
    out = tmp_path / "out.json"
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
        "OMP_NUM_THREADS": "1",
        "TR_TEST_READS": str(ranks),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    proc = subprocess.run(
        [*cmd, str(_SCRIPT), str(out), str(num_workers)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["trained"] == trained_alone()  # InvariantDataParallel on the packed stream
    for name, ref in reference.items():
        assert merge(result[name]["batches"]) == ref, name
        assert_resumes(name, result[name]["states"], ref, [(1, 0)])
    total = sum(one.values())
    per_rank = [sum(reads(ranks, r).values()) for r in range(world)]
    # Each rank also reads ahead (whole shards in flight, wasted where an epoch ends): on these
    # 16-shard epochs that is up to a third more. Without partitions each rank reads all of it.
    assert sum(per_rank) < total * 1.4, (per_rank, total)
    assert all(0 < n < total * 1.5 / world for n in per_rank), (per_rank, total)


# -- what each transform does ------------------------------------------------------------------


def in_order(ds: torchrepro.ShardedDataset, **kwargs: Any) -> list[Any]:
    """Every unit of one epoch, in stream order (one partition, no shuffling)."""
    loader = torchrepro.SeededLoader(
        ds, batch_size=1, shuffle=False, seed=5, collate_fn=lambda s: s[0], **kwargs
    )
    return list(loader)


@pytest.mark.parametrize("seq_len", [1, 3, 6, 50])
def test_packing_keeps_every_token_but_the_remainder(seq_len: int) -> None:
    """The blocks are the documents' tokens (drawn per document, keyed: the same as unpacked)
    cut every seq_len, with each token's position in its document and its document's number in
    the block; only the last partial block is dropped."""
    docs = torchrepro.ShardedDataset(range(len(script.LENGTHS)), script.read_doc)
    documents = [torch.as_tensor(d["input_ids"], dtype=torch.int64) for d in in_order(docs)]
    tokens = torch.cat(documents)
    positions = torch.cat([torch.arange(len(d)) for d in documents])
    starts = torch.cat([torch.arange(len(d)) == 0 for d in documents])
    blocks = in_order(docs.pack(seq_len))
    assert len(blocks) == len(tokens) // seq_len > 0
    for b, block in enumerate(blocks):
        cut = slice(b * seq_len, (b + 1) * seq_len)
        assert torch.equal(block["input_ids"], tokens[cut])
        assert torch.equal(block["position_ids"], positions[cut])
        first = 1 if positions[cut][0] == 0 else 0  # a document continued from the last block is 0
        expected = torch.cumsum(starts[cut].long(), 0) - first
        assert torch.equal(block["document_ids"], expected)


def test_filter_keeps_exactly_the_samples_the_predicate_keeps() -> None:
    docs = torchrepro.ShardedDataset(range(len(script.LENGTHS)), script.read_doc)
    every = [d["id"] for d in in_order(docs)]
    kept = [d["id"] for d in in_order(docs.filter(lambda d: d["id"] % 3 != 0).filter(lambda d: d["id"] % 5))]
    assert kept == [i for i in every if i % 3 and i % 5] and kept


def counted_source(tag: int, shards: int, per_shard: int) -> torchrepro.ShardedDataset:
    return torchrepro.ShardedDataset([(tag, s, per_shard) for s in range(shards)], _tagged)


def _tagged(shard: tuple[int, int, int]):
    tag, s, n = shard
    return ({"source": tag, "id": s * 1000 + o} for o in range(n))


def test_mix_draws_each_source_in_proportion() -> None:
    """Over 6000 positions, each source's share is its weight's within 4 standard deviations."""
    sources = [counted_source(0, 40, 200), counted_source(1, 40, 200), counted_source(2, 40, 200)]
    weights = [0.5, 0.3, 0.2]
    loader = torchrepro.SeededLoader(
        torchrepro.ShardedDataset.mix(sources, weights), batch_size=100, seed=1, collate_fn=list
    )
    drawn = Counter[int]()
    for i, batch in enumerate(loader):
        drawn.update(s["source"] for s in batch)
        if i == 59:
            break
    n = sum(drawn.values())
    for a, w in enumerate(weights):
        assert abs(drawn[a] / n - w) < 4 * (w * (1 - w) / n) ** 0.5, (drawn, n)


def test_a_mix_stops_where_its_source_runs_out_or_skips_it() -> None:
    small, large = counted_source(0, 2, 5), counted_source(1, 10, 100)
    stop = in_order(torchrepro.ShardedDataset.mix([small, large], [0.5, 0.5]))
    skip = in_order(torchrepro.ShardedDataset.mix([small, large], [0.5, 0.5], exhausted="skip"))
    # "stop": every sample of the small source, then the stream ends at its next draw, long before
    # the large source is read through; "skip": every sample of both, each once.
    assert sum(s["source"] == 0 for s in stop) == 10
    assert sum(s["source"] == 1 for s in stop) < 100
    assert sorted((s["source"], s["id"]) for s in skip) == sorted(
        [(0, s * 1000 + o) for s in range(2) for o in range(5)]
        + [(1, s * 1000 + o) for s in range(10) for o in range(100)]
    )
    assert stop == skip[: len(stop)]  # the same draws until the small source runs out


# -- negative controls ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["packed", "mixed"])
def test_plain_dataloader_over_a_packed_or_mixed_stream_changes_with_num_workers(
    name: str, rng_changes_ok: None
) -> None:
    """Negative control: a plain DataLoader hands each worker its own shards, which it packs and
    mixes alone: the blocks and the mix change with num_workers."""
    docs = torchrepro.ShardedDataset(range(len(script.LENGTHS)), script.read_doc)
    code = torchrepro.ShardedDataset(range(8), script.read_code)
    ds = docs.pack(6) if name == "packed" else torchrepro.ShardedDataset.mix([docs, code], weights=[0.7, 0.3])
    zero = [script.collate(b) for b in DataLoader(ds, batch_size=2, collate_fn=list)]
    two = [script.collate(b) for b in DataLoader(ds, batch_size=2, num_workers=2, collate_fn=list)]
    assert zero != two


def test_hf_stream_split_by_rank_changes_with_the_world_size(rng_changes_ok: None) -> None:
    """Negative control: datasets' split_dataset_by_node gives rank r the shards r, r+W, ...:
    the global batches differ between 1 and 2 processes. The same stream through
    ShardedDataset.from_hf and partitions gives one sequence."""
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    hf = datasets.Dataset.from_dict({"id": list(range(96))}).to_iterable_dataset(num_shards=8)

    def split(world: int) -> list[list[int]]:
        per_rank = [
            [
                b["id"].tolist()
                for b in DataLoader(split_dataset_by_node(hf, rank=r, world_size=world), batch_size=4)
            ]
            for r in range(world)
        ]
        return [mb for step in zip(*per_rank, strict=True) for mb in step]

    assert split(1) != split(2)

    def ours(world: int) -> list[Any]:
        loaders = [
            torchrepro.SeededLoader(
                torchrepro.ShardedDataset.from_hf(hf),
                batch_size=4,
                global_batch_size=8,
                drop_last=True,
                partitions=4,
                seed=0,
                rank=r,
                world_size=world,
            )
            for r in range(world)
        ]
        per_rank = [[b["id"].tolist() for b in loader] for loader in loaders]
        a = 2 // world
        return [
            mb
            for s in range(len(per_rank[0]) // a)
            for batches in per_rank
            for mb in batches[s * a : (s + 1) * a]
        ]

    assert ours(1) == ours(2) and len(ours(1)) == 24


# -- errors ------------------------------------------------------------------------------------


def test_bad_partitioned_configurations_say_what_to_change() -> None:
    docs = torchrepro.ShardedDataset(range(len(script.LENGTHS)), script.read_doc)
    with pytest.raises(LoaderConfigError, match="global_batch_size"):
        torchrepro.SeededLoader(docs, batch_size=2, partitions=4, seed=0)
    with pytest.raises(LoaderConfigError, match="has 16 shards"):
        torchrepro.SeededLoader(
            docs, batch_size=2, global_batch_size=4, drop_last=True, partitions=32, seed=0
        )
    three = script.loader(docs, rank=0, world_size=3)
    with pytest.raises(LoaderConfigError, match="World sizes that work: 1, 2, 4"):
        next(iter(three))
    six = script.loader(docs, global_batch_size=12, rank=0, world_size=3)  # V = 6, P = 4
    with pytest.raises(LoaderConfigError, match=r"dividing both \(1, 2\)"):
        next(iter(six))
    with pytest.raises(LoaderConfigError, match="filter the documents first"):
        docs.pack(4).filter(bool)
    with pytest.raises(LoaderConfigError, match="pack once"):
        docs.pack(4).pack(4)
    with pytest.raises(ValueError, match="one positive finite weight per source"):
        torchrepro.ShardedDataset.mix([docs, docs], weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="exhausted must be one of"):
        torchrepro.ShardedDataset.mix([docs], exhausted="cycle")
    with pytest.raises(LoaderConfigError, match="packed differently"):
        torchrepro.ShardedDataset.mix([docs.pack(4), docs])
    with pytest.raises(ShardReadError, match=r"has \['id', 'input_ids', 'r'\]. Pass key="):
        list(torchrepro.SeededLoader(docs.pack(4, key="tokens"), batch_size=1, seed=0))


def test_a_state_of_another_pipeline_is_refused_by_name() -> None:
    saver = script.loader(DATASETS["packed"])
    next(iter(saver))
    state = saver.state_dict()
    docs = torchrepro.ShardedDataset(range(len(script.LENGTHS)), script.read_doc)
    other = script.loader(docs.filter(script.keep).pack(5))
    with pytest.raises(DataLoaderStateError, match=r"pack: state has \[6, 'input_ids'\]"):
        other.load_state_dict(state)
    unpartitioned = torchrepro.SeededLoader(
        docs, batch_size=2, global_batch_size=8, drop_last=True, shuffle_buffer=6, seed=11
    )
    with pytest.raises(DataLoaderStateError, match="no shard_lengths list"):
        unpartitioned.load_state_dict(state)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_a_position_after_the_epochs_last_global_batch_has_an_empty_rest(name: str) -> None:
    """What the Hugging Face integration asks of a restored stream: a state saved inside the loop
    after the last global batch has nothing left in its epoch, one saved before it has."""
    n = len(list(script.loader(DATASETS[name])))
    for consumed, empty in ((n, True), (n - 4, False), (0, False)):
        saver = script.loader(DATASETS[name])
        it = iter(saver)
        for _ in range(consumed):
            next(it)
        resumed = script.loader(DATASETS[name])
        resumed.load_state_dict(saver.state_dict())
        assert resumed._rest_is_empty() is empty, consumed
        assert (list(resumed) == []) is empty


def test_known_shard_lengths_deal_the_partitions_evenly() -> None:
    """An epoch ends where its first partition runs out. Dealt round robin, 32 shards of 1-120
    samples leave 12% behind; dealt by their lengths (longest first, to the emptiest partition),
    0.4%: the same global batches on 1 and 2 ranks, resumable onto 4."""
    lengths = [(s * 53) % 120 + 1 for s in range(32)]

    def read(shard: int):
        return ({"id": shard * 1000 + o, "r": torch.rand(()).item()} for o in range(lengths[shard]))

    def loader(ds: torchrepro.ShardedDataset, **kwargs: Any) -> torchrepro.SeededLoader:
        return torchrepro.SeededLoader(
            ds,
            batch_size=4,
            global_batch_size=16,
            drop_last=True,
            partitions=4,
            seed=0,
            collate_fn=list,
            **kwargs,
        )

    total = sum(lengths)
    dealt = torchrepro.ShardedDataset(range(32), read)
    balanced = torchrepro.ShardedDataset(range(32), read, lengths=lengths)
    assert sum(len(b) for b in loader(dealt)) < 0.92 * total
    whole = loader(balanced)
    one = [b for _ in range(2) for b in whole]  # two epochs
    assert 0.98 * total < len(one) * 4 / 2
    two = [loader(balanced, rank=r, world_size=2) for r in range(2)]
    per_rank = [[b for _ in range(2) for b in each] for each in two]
    assert [
        mb for s in range(len(one) // 4) for batches in per_rank for mb in batches[s * 2 : s * 2 + 2]
    ] == one
    saver = loader(balanced)
    it = iter(saver)
    for _ in range(4 * 9):
        next(it)
    resumed = [loader(balanced, rank=r, world_size=4) for r in range(4)]
    for each in resumed:
        each.load_state_dict(saver.state_dict())
    rest = [[b for _ in range(2) for b in each] for each in resumed]
    assert [mb for s in range(len(rest[0])) for batches in rest for mb in batches[s : s + 1]] == one[36:][
        : len(rest[0]) * 4
    ]
    with pytest.raises(ValueError, match="lengths must give each of the 32 shards"):
        torchrepro.ShardedDataset(range(32), read, lengths=lengths[:-1])
