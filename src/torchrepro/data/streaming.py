"""``SeededLoader`` over a ``ShardedDataset``: a stream whose order and draws depend on (seed, epoch) only.

Invariants:
- The global sequence of an epoch: the shards in the order ``derive_seed(seed, "shards", e)``
  draws (their list order with ``shuffle=False``), read one after another, through the shuffle
  buffer keyed by (seed, epoch, output position) (``shuffle``). Every sample is read seeded by
  its own key (``sharded``). Nothing in it depends on ``num_workers``, persistent workers or the
  world size.
- Workers read whole shards (a task is a shard from an offset, loaded by the inner
  ``DataLoader`` in order); the main process keeps the buffer, cuts the sequence into steps and
  collates this rank's part, seeded from ``derive_seed(seed, "batch", e, global batch index)``.
  A step is ``batch_size * world_size`` samples, rank ``r`` taking the ``r``-th ``batch_size``
  of it; with ``global_batch_size`` a step is a global batch and rank ``r`` takes its block of
  micro-batches, as for a map-style dataset. Every rank reads every shard (the stream decides
  which samples a rank gets only after they are read).
- The position is a number of samples of the global sequence (whole steps), plus the lengths of
  the shards read in the epoch: a resume replays the shuffle on sample ids, loads only the shards
  still holding buffered samples (from the first one needed, ``read_shard(shard, start)`` when
  the function takes it) and the shards after, and continues, on any worker count, and on any
  world size whose step divides the position.
- In the main process the global RNG states are put back after each shard and each batch.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler, default_collate
from torch.utils.data.distributed import DistributedSampler

from torchrepro._compat import numpy_or_none
from torchrepro._runtime import process_group
from torchrepro.data.loader import (
    OWN_GENERATORS,
    STATE_VERSION,
    SeededLoader,
    SeededLoaderIter,
    checked_arguments,
    fixed_shard,
)
from torchrepro.data.micro import check_global_batch_size, micro_batches_per_rank
from torchrepro.data.partitions import (
    END,
    Layout,
    Partition,
    Reader,
    agree,
    build,
    check_partitions,
    groups_for,
    sources_of,
)
from torchrepro.data.rawrng import _python_mt, numpy_mt
from torchrepro.data.sampler import FollowsGroup, Position
from torchrepro.data.sharded import TASK_MARK, ShardedDataset, ShardTasks, Task, as_is
from torchrepro.data.shuffle import replay
from torchrepro.data.view import _active
from torchrepro.errors import DataLoaderStateError, LoaderConfigError
from torchrepro.seeding import Deriver, derive_seed, sample_seeder

__all__ = ["DEFAULT_SHUFFLE_BUFFER", "ShardedDataset", "StreamingLoader"]

DEFAULT_SHUFFLE_BUFFER = 1000
"""Samples the shuffle buffer holds when ``shuffle=True`` and no ``shuffle_buffer`` is given."""


class _StreamSampler(Position, FollowsGroup, DistributedSampler[Task]):  # type: ignore[override]
    """The position of a streaming loader, and the shard tasks of the pass under way.

    A ``DistributedSampler`` only so that frameworks which give a distributed loader one of their
    own (Lightning's ``use_distributed_sampler``) keep it: the stream shares its steps by rank.
    """

    def __init__(self, shard: tuple[int, int] | None) -> None:
        # DistributedSampler.__init__ needs a process group or a fixed shard; neither is needed here.
        Sampler.__init__(self)
        Position.__init__(self)
        self.fixed_shard = shard
        self.tasks: list[Task] = []
        self.lengths: dict[int, int] = {}  # shard index -> length, in `lengths_epoch`
        self.lengths_epoch = 0
        self.feed: Reader | None = None  # a partitioned pass's demand-driven tasks
        self.counts: dict[int, list[int]] = {}  # partitioned: shard index -> [kept, tokens]
        self.counts_epoch = 0

    def __iter__(self) -> Iterator[Task]:
        return self.feed if self.feed is not None else iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)


class StreamingLoader(SeededLoader):
    """``SeededLoader(ShardedDataset(...), batch_size=..., seed=..., shuffle_buffer=N)``.

    The samples of epoch ``e`` come in one global sequence, a function of (seed, epoch) only:
    the shards in an order drawn from (seed, e) (list order with ``shuffle=False``), read one
    after another, through a shuffle buffer of ``shuffle_buffer`` samples (default
    ``DEFAULT_SHUFFLE_BUFFER`` with ``shuffle=True``, none with ``shuffle=False``) whose draws
    are keyed by (seed, e, position). Each sample is read with the global RNGs seeded from
    (seed, e, shard, offset) and ``sample_rng()`` keyed the same; ``collate_fn`` runs seeded
    per batch. The sequence and every draw are the same for any ``num_workers``, persistent
    workers or not, and any world size: each rank takes its ``batch_size`` of every
    ``batch_size * world_size`` samples (with ``global_batch_size``: its micro-batches of every
    global batch, which then needs ``drop_last=True``). The last incomplete step is dropped with
    ``drop_last``, else split over the ranks, padded by repeating its own samples.

    ``state_dict()`` holds the position (samples of the global sequence, and the lengths of the
    shards read this epoch), never the buffer's contents; ``load_state_dict`` resumes on another
    ``num_workers``, or another world size when its step divides the position, reading only the
    shards that still hold samples. The loader has no length (``len()`` raises ``TypeError``).

    With ``partitions=P`` (which needs ``global_batch_size``), and for every filtered, packed or
    mixed stream (one partition unless given), the sequence is built from partitions instead
    (``data.partitions``): each a keyed stream over its own shards, so that under
    ``torch.distributed`` a rank reads only its partitions' shards; the global batches are a
    function of (seed, epoch, P, data) for any ``num_workers`` and any world size dividing ``P``
    and the micro-batch count.
    """

    # Its torch iterator moves shards, not batches: a run's recorder takes the batches from the
    # loader's own iterator instead (``_child.hooks``).
    _tr_batches_elsewhere = True

    def __init__(
        self,
        dataset: ShardedDataset,
        *,
        batch_size: int,
        seed: int | None = None,
        shuffle: bool = True,
        num_workers: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        global_batch_size: int | None = None,
        shuffle_buffer: int | None = None,
        partitions: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        seed = checked_arguments(batch_size, shuffle, drop_last, seed, dataloader_kwargs)
        if partitions is not None:
            if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
                raise ValueError(f"partitions must be a positive int, got {partitions!r}.")
            if global_batch_size is None:
                raise LoaderConfigError(
                    "partitions= shares a stream's global batches among the ranks by partition: pass "
                    "global_batch_size= too (the samples of one optimizer step over all ranks, e.g. "
                    "batch_size * world_size without accumulation) and drop_last=True."
                )
            check_partitions(dataset, partitions)
        if shuffle_buffer is None:
            shuffle_buffer = DEFAULT_SHUFFLE_BUFFER if shuffle else 1
        elif isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int) or shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be a positive int (samples held), got {shuffle_buffer!r}.")
        elif not shuffle and shuffle_buffer > 1:
            raise LoaderConfigError(
                f"shuffle=False keeps the stream's order, but shuffle_buffer={shuffle_buffer} would shuffle "
                "it: drop one of them."
            )
        if global_batch_size is not None:
            check_global_batch_size(global_batch_size, batch_size)
            if not drop_last:
                raise LoaderConfigError(
                    "A stream's length is unknown until it ends, so its last global batch may be "
                    "incomplete, and its mean would have another denominator and shape on each world "
                    "size: pass drop_last=True with global_batch_size (the incomplete global batch at "
                    "the end of each epoch is dropped)."
                )
        sampler = _StreamSampler(fixed_shard(rank, world_size))
        collate_fn = dataloader_kwargs.pop("collate_fn", None) or default_collate
        generator = torch.Generator()
        generator.manual_seed(derive_seed(seed, "workers", 0))
        OWN_GENERATORS.add(generator)
        DataLoader.__init__(
            self,
            ShardTasks(dataset, seed),
            batch_size=None,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=as_is,
            generator=generator,
            **dataloader_kwargs,
        )
        # What the loop sees: the batches this loader builds (the inner loader moves shards).
        object.__setattr__(self, "batch_size", batch_size)
        object.__setattr__(self, "drop_last", drop_last)
        self._seed = seed
        self._shuffle = shuffle
        self._seeded_sampler = sampler  # type: ignore[assignment]
        self._stream = dataset
        self._collate = collate_fn
        self._buffer_size = shuffle_buffer
        self._global = global_batch_size
        # Partitioned (explicitly, or 1 for a filtered, packed or mixed stream), else None.
        self._partitions = partitions if partitions is not None else (1 if dataset.transformed else None)
        self._split = partitions is not None  # ranks read their own partitions (with a process group)

    # -- shape ------------------------------------------------------------------------------

    @property
    def source_dataset(self) -> ShardedDataset:
        return self._stream

    @property
    def shuffle_buffer(self) -> int:
        return self._buffer_size

    @property
    def global_batch_size(self) -> int | None:
        return self._global

    @property
    def micro_batches(self) -> int:
        return 1 if self._global is None else self._global // self._batch_size

    @property
    def _batch_size(self) -> int:
        size = self.batch_size
        assert size is not None
        return size

    @property
    def partitions(self) -> int | None:
        """The partitions of the stream (None: the whole stream is read by every rank, as one)."""
        return self._partitions

    @property
    def accumulation_steps(self) -> int:
        return self._per_step(process_group(self._seeded_sampler.fixed_shard)[1])

    def _per_step(self, world_size: int) -> int:
        """The batches a rank gets of each step: 1, or its micro-batches of a global batch."""
        if self._global is None:
            return 1
        per_rank = micro_batches_per_rank(self._global, self._batch_size, world_size)
        if self._split:
            assert self._partitions is not None
            groups_for(self._partitions, self._global // self._batch_size, world_size)
        return per_rank

    def _layout(self, world_size: int) -> Layout:
        """Where the units of a step come from (a partitioned stream)."""
        assert self._partitions is not None
        if not self._split:
            return Layout(1, 1, self._step(world_size))
        v = self.micro_batches
        return Layout(self._partitions, groups_for(self._partitions, v, world_size), self._step(world_size))

    def _step(self, world_size: int) -> int:
        """Samples of the global sequence one step consumes on ``world_size`` ranks."""
        return self._global if self._global is not None else self._batch_size * world_size

    def __len__(self) -> int:
        raise TypeError(
            "A streamed SeededLoader has no length: its shards' lengths are known only once read."
        )

    def __iter__(self) -> _StreamIter:  # type: ignore[override]
        return _StreamIter(self)

    def _shard_order(self, epoch: int) -> list[int]:
        n = len(self._stream.shards)
        if not self._shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(derive_seed(self._seed, "shards", epoch))
        return torch.randperm(n, generator=generator).tolist()

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position as JSON: samples of the epoch's global sequence consumed (whole steps), the
        batches this rank received, the lengths of the shards read this epoch, and what the
        sequence depends on."""
        pos = self._seeded_sampler
        return self._state(pos.batches, pos.finished)

    def _state(self, batches: int, finished: bool) -> dict[str, Any]:
        """``state_dict()`` with another position in the current epoch: ``batches`` received, the
        pass ended or not (for a framework that fetches ahead of its training loop)."""
        pos = self._seeded_sampler
        assert isinstance(pos, _StreamSampler)
        rank, world_size = process_group(pos.fixed_shard)
        per_step = self._per_step(world_size)
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "stream": True,
            "seed": self._seed,
            "epoch": pos.epoch,
            "batches_consumed": batches,
            "samples_consumed": batches // per_step * self._step(world_size),
            "finished": finished,
            "num_shards": len(self._stream.shards),
            "batch_size": self._batch_size,
            "global_batch_size": self._global,
            "shuffle_buffer": self._buffer_size,
            "drop_last": self.drop_last,
            "shuffle": self._shuffle,
            "rank": rank,
            "world_size": world_size,
        }
        if self._partitions is None:
            lengths = pos.lengths if pos.lengths_epoch == pos.epoch else {}
            state["shard_lengths"] = [lengths.get(i) for i in range(len(self._stream.shards))]
            return state
        counts = pos.counts if pos.counts_epoch == pos.epoch else {}
        sources, _, weights, exhausted = sources_of(self._stream)
        state.update(
            shard_counts=[counts.get(i) for i in range(len(self._stream.shards))],
            partitions=self._partitions,
            split=self._split,
            sources=[len(source.shards) for source in sources],
            weights=weights,
            exhausted=exhausted,
            filters=[len(source._filters) for source in sources],
            balanced=[source.lengths is not None for source in sources],
            pack=list(self._stream.packing) if self._stream.packing is not None else None,
        )
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue after the position in ``state_dict``, on this loader's worker count and world
        size. A different seed, shard count, batch size, ``global_batch_size``, shuffle buffer,
        ``shuffle`` or ``drop_last`` raises ``DataLoaderStateError``, as does a position inside
        a step of another world size."""
        if not isinstance(state_dict, Mapping) or not state_dict.get("stream"):
            raise DataLoaderStateError(
                "This loader streams a ShardedDataset: load the state a streamed SeededLoader's "
                "state_dict() returned."
            )
        if state_dict.get("version") != STATE_VERSION:
            raise DataLoaderStateError(
                f"Loader state has version {state_dict.get('version')!r}, this torchrepro reads version "
                f"{STATE_VERSION}."
            )
        expected = self.state_dict()
        compared: tuple[str, ...] = (
            "seed",
            "num_shards",
            "batch_size",
            "global_batch_size",
            "shuffle_buffer",
            "shuffle",
            "drop_last",
        )
        if self._partitions is not None:
            compared += (
                "partitions",
                "split",
                "sources",
                "weights",
                "exhausted",
                "filters",
                "balanced",
                "pack",
            )
        mismatches = [
            f"{key}: state has {state_dict.get(key)!r}, this loader has {expected[key]!r}"
            for key in compared
            if state_dict.get(key) != expected[key]
        ]
        if mismatches:
            raise DataLoaderStateError(
                "Loader state does not fit this SeededLoader (" + "; ".join(mismatches) + "). Create the "
                "loader with the same shards, seed, batch_size, global_batch_size, shuffle_buffer, "
                "shuffle and drop_last (and partitions, mix, filters and packing) as the run that saved "
                "the state."
            )
        for key in ("epoch", "batches_consumed", "samples_consumed", "world_size"):
            value = state_dict.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DataLoaderStateError(f"Loader state has {key}={value!r}; expected an int >= 0.")
        field = "shard_lengths" if self._partitions is None else "shard_counts"
        lengths = state_dict.get(field)
        if not isinstance(lengths, list) or len(lengths) != expected["num_shards"]:
            raise DataLoaderStateError(f"Loader state has no {field} list with one entry per shard.")
        if any(n is not None and not _count(n, self._partitions is not None) for n in lengths):
            raise DataLoaderStateError(f"Loader state has an entry of {field} that is not a count >= 0.")
        finished = state_dict.get("finished")
        if not isinstance(finished, bool):
            raise DataLoaderStateError(f"Loader state has finished={finished!r}; expected a bool.")
        epoch, batches = state_dict["epoch"], state_dict["batches_consumed"]
        pos = self._seeded_sampler
        assert isinstance(pos, _StreamSampler)
        world_size = expected["world_size"]
        if finished:
            epoch, batches, lengths = epoch + 1, 0, [None] * len(lengths)
        elif state_dict["world_size"] != world_size:
            samples, step = state_dict["samples_consumed"], self._step(world_size)
            saved_step = self._step(state_dict["world_size"])
            if batches % self._per_step(state_dict["world_size"]) or samples % step:
                raise DataLoaderStateError(
                    f"Loader state was saved {samples} samples (plus "
                    f"{batches % self._per_step(state_dict['world_size'])} batches) into epoch {epoch} by "
                    f"{state_dict['world_size']} processes, steps of {saved_step} samples; on {world_size} "
                    f"processes a step is {step} samples, and {samples} is not a whole number of them. "
                    f"Resume on {state_dict['world_size']} processes, or on a world size whose step "
                    "divides the position."
                )
            batches = samples // step * self._per_step(world_size)
        pos.restore(epoch, batches)
        if self._partitions is None:
            pos.lengths = {i: n for i, n in enumerate(lengths) if n is not None}
            pos.lengths_epoch = epoch
        else:
            pos.counts = {i: list(n) for i, n in enumerate(lengths) if n is not None}
            pos.counts_epoch = epoch

    def _rest_is_empty(self) -> bool:
        """Whether the next pass, continuing a restored position, yields no batch: every shard of
        its epoch was read, and fewer samples are left than its next step takes (none, or an
        incomplete step with ``drop_last``)."""
        pos = self._seeded_sampler
        assert isinstance(pos, _StreamSampler)
        if self._partitions is not None:
            return pos.pending and _partitioned_rest_is_empty(self)
        if not pos.pending or pos.lengths_epoch != pos.epoch or len(pos.lengths) < len(self._stream.shards):
            return False
        world_size = process_group(pos.fixed_shard)[1]
        step = self._step(world_size)
        left = sum(pos.lengths.values()) - pos.batches // self._per_step(world_size) * step
        return left <= 0 or (self.drop_last and left < step)


ShardedDataset._tr_loader = StreamingLoader  # SeededLoader(ShardedDataset(...)) builds one


class _StreamIter(SeededLoaderIter):
    """One pass of a streaming loader: the batches of this rank, from the position."""

    def _batches(self) -> Iterator[Any]:
        loader = self._loader
        assert isinstance(loader, StreamingLoader)
        if loader._partitions is not None:
            return _partitioned_pass(loader, self._received)
        return _pass(loader, self._received)

    def __len__(self) -> int:
        raise TypeError("A streamed SeededLoader has no length.")


def _pass(loader: StreamingLoader, received: int) -> Iterator[Any]:
    """The batches of the pass under way, after the ``received`` ones."""
    pos = loader._seeded_sampler
    assert isinstance(pos, _StreamSampler)
    epoch, seed = pos.epoch, loader._seed
    if pos.lengths_epoch != epoch:
        pos.lengths, pos.lengths_epoch = {}, epoch
    rank, world_size = process_group(pos.fixed_shard)
    per_step, step = loader._per_step(world_size), loader._step(world_size)
    batch_size = loader._batch_size
    steps_done, skip = divmod(received, per_step)
    consumed = steps_done * step
    order = loader._shard_order(epoch)
    known = []
    for index in order:
        if index not in pos.lengths:
            break
        known.append(pos.lengths[index])
    complete = len(known) == len(order)
    if complete and consumed >= sum(known):
        return  # saved after the last batch of the epoch: its rest is empty
    try:
        buffer, frontier = replay(seed, epoch, loader._buffer_size, known, consumed, complete=complete)
    except ValueError as e:
        raise DataLoaderStateError(
            f"The loader's position ({consumed} samples into epoch {epoch}) lies beyond the shards it "
            f"knows the lengths of ({e}); load a state saved by this loader's state_dict()."
        ) from None
    needed: dict[int, set[int]] = {}
    for p, o in buffer.items:
        needed.setdefault(p, set()).add(o)
    starts = {p: min(offsets) for p, offsets in needed.items()}
    fp, fo = frontier
    if fp < len(order):
        starts[fp] = min(starts.get(fp, fo), fo)
        starts.update({p: 0 for p in range(fp + 1, len(order))})
    pos.tasks = [(epoch, order[p], p, starts[p], TASK_MARK) for p in sorted(starts)]
    shards = DataLoader.__iter__(loader) if pos.tasks else iter(())

    contents: dict[tuple[int, int], Any] = {}

    def sequence() -> Iterator[Any]:
        for p, result, length in shards:
            pos.lengths[order[p]] = length
            samples = pickle.loads(result) if isinstance(result, bytes) else result  # from a worker
            wanted = needed.pop(p, ())
            for o, sample in samples:
                ident = (p, o)
                if o in wanted:
                    contents[ident] = sample
                if ident >= frontier:
                    contents[ident] = sample
                    out = buffer.push(ident)
                    if out is not None:
                        yield contents.pop(out)
        for out in buffer.drain():
            yield contents.pop(out)

    batch_key = Deriver(seed, ("batch", epoch), 3)
    group = world_size * per_step  # batches of `batch_size` in a step
    items: list[Any] = []
    step_index = steps_done
    for sample in sequence():
        items.append(sample)
        if len(items) < step:
            continue
        for a in range(skip, per_step):
            part = rank * per_step + a
            yield _collate(
                loader,
                items[part * batch_size : (part + 1) * batch_size],
                batch_key,
                step_index * group + part,
            )
        items, skip = [], 0
        step_index += 1
    if items and not loader.drop_last:
        yield _collate(loader, _last_share(items, rank, world_size), batch_key, step_index * group + rank)


def _last_share(items: list[Any], rank: int, world_size: int) -> list[Any]:
    """This rank's part of an epoch's incomplete last step: split over the ranks, padded by
    repeating the step's own samples."""
    share = -(-len(items) // world_size)
    padded = (items * (-(-share * world_size // len(items))))[: share * world_size]
    return padded[rank * share : (rank + 1) * share]


def _collate(loader: StreamingLoader, samples: list[Any], key: Deriver, batch_index: int) -> Any:
    """``collate_fn(samples)`` seeded from the global batch index; the main process's global RNG
    states put back after it."""
    np = numpy_or_none()
    saved = (_python_mt.save(), numpy_mt.save(np) if np is not None else None, torch.get_rng_state())
    active = _active
    outer = (active.seed, active.rng)
    try:
        s = key.one(batch_index)
        sample_seeder(np)(s)
        active.seed, active.rng = s, None
        return loader._collate(samples)
    finally:
        active.seed, active.rng = outer
        _python_mt.restore(saved[0])
        if np is not None:
            numpy_mt.restore(np, saved[1])
        torch.set_rng_state(saved[2])


def _count(entry: Any, summary: bool) -> bool:
    """Whether ``entry`` is a shard length (an int >= 0) or, ``summary``, ``[kept, tokens]``."""
    if not summary:
        return not isinstance(entry, bool) and isinstance(entry, int) and entry >= 0
    return isinstance(entry, list) and len(entry) == 2 and all(_count(n, False) for n in entry)


@dataclass
class _Plan:
    """A partitioned pass: where this rank stands and the partitions it reads, replayed to its start."""

    rank: int
    world_size: int
    per_step: int  # micro-batches of a step this rank yields
    layout: Layout
    split: bool  # this rank reads only its own partitions (and agrees with the others each step)
    units: range  # the units of a step this rank builds
    reader: Reader
    parts: dict[int, Partition]
    step: int  # the step the pass continues at
    skip: int  # micro-batches of that step already received


def _plan(loader: StreamingLoader, received: int) -> _Plan:
    """A partitioned pass from ``received`` batches: its partitions replayed to the position."""
    pos = loader._seeded_sampler
    assert isinstance(pos, _StreamSampler) and loader._partitions is not None
    epoch = pos.epoch
    if pos.counts_epoch != epoch:
        pos.counts, pos.counts_epoch = {}, epoch
    rank, world_size = process_group(pos.fixed_shard)
    per_step = loader._per_step(world_size)
    layout = loader._layout(world_size)
    # Ranks read their own partitions when they can agree on the epoch's end (a process group).
    split = loader._split and world_size > 1 and pos.fixed_shard is None
    units = layout.owned(rank, world_size) if split else range(layout.step)
    mine = layout.partitions_of(units) if split else range(layout.partitions)
    reader = Reader(epoch, lambda: DataLoader.__iter__(loader))
    pos.feed = reader
    stream, capacity = loader._stream, loader._buffer_size
    parts = build(
        stream, loader._seed, epoch, layout.partitions, loader._shuffle, capacity, pos.counts, reader, mine
    )
    step, skip = divmod(received, per_step)
    for p, part in parts.items():
        part.replay(layout.taken(p, step * layout.step))
    return _Plan(rank, world_size, per_step, layout, split, units, reader, parts, step, skip)


def _partitioned_pass(loader: StreamingLoader, received: int) -> Iterator[Any]:
    """The batches of a partitioned pass after the ``received`` ones."""
    plan = _plan(loader, received)
    pos = loader._seeded_sampler
    assert isinstance(pos, _StreamSampler)
    try:
        yield from _steps(loader, plan)
    finally:  # the inner iterator goes now, in this process (a later pass's workers must not inherit it)
        plan.reader.close()
        if pos.feed is plan.reader:
            pos.feed = None


def _steps(loader: StreamingLoader, plan: _Plan) -> Iterator[Any]:
    pos = loader._seeded_sampler
    assert isinstance(pos, _StreamSampler)
    for part in plan.parts.values():
        part.preload()
    rank, world_size, per_step, layout = plan.rank, plan.world_size, plan.per_step, plan.layout
    batch_key = Deriver(loader._seed, ("batch", pos.epoch), 3)
    group = world_size * per_step
    m = loader._batch_size
    share = layout.step // world_size
    step, skip = plan.step, plan.skip
    items: list[Any] = []
    while True:
        items = []
        ok = True
        for i in plan.units:
            sample = plan.parts[layout.partition(step, i)].next()
            if sample is END:
                ok = False
                break
            items.append(sample)
        if plan.split:
            ok, news = agree(ok, plan.reader.news)
            for index, summary in news:
                pos.counts.setdefault(index, summary)
        plan.reader.news = []
        if not ok:
            break
        own = items if plan.split else items[rank * share : (rank + 1) * share]
        for a in range(skip, per_step):
            yield _collate(loader, own[a * m : (a + 1) * m], batch_key, step * group + rank * per_step + a)
        skip = 0
        step += 1
    if items and not plan.split and not loader.drop_last:  # the incomplete last step
        yield _collate(loader, _last_share(items, rank, world_size), batch_key, step * group + rank)


def _partitioned_rest_is_empty(loader: StreamingLoader) -> bool:
    """Whether a restored position of a partitioned stream has no step left in its epoch: some
    partition's shards are all known and hold too few units for the next step (False when no
    state says so)."""
    pos = loader._seeded_sampler
    assert isinstance(pos, _StreamSampler)
    try:
        plan = _plan(loader, pos.batches)
    finally:
        pos.feed = None
    layout = plan.layout
    following = plan.step * layout.step + (layout.step if loader.drop_last else 1)
    for p, part in plan.parts.items():
        total, complete = part.count_to_end()
        if complete and total < layout.taken(p, following):
            return True
    return False
