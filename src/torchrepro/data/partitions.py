"""Partitioned streams: ``SeededLoader(sharded, ..., partitions=P)``, and every filtered, packed or
mixed stream (``P = 1`` unless given).

Invariants:
- Epoch ``e`` deals each source's shards to the ``P`` partitions: source ``a``'s shards in the
  order ``derive_seed(seed, "shards", e, a)`` draws (list order with ``shuffle=False``), partition
  ``p`` taking every ``P``-th from the ``p``-th, or, when the source knows its shards' lengths,
  each to the partition with the fewest samples so far. A partition's stream reads, per source, its
  shards one after another (filters applied as each sample is read, packed into blocks after);
  a mix draws the source of its position ``k`` from ``derive_seed(seed, "mix", e, p, k)``; the
  units go through the partition's shuffle buffer, keyed ``(seed, "shuffle", e, p, position)``.
  Nothing in a partition's output depends on ``num_workers``, the world size or who read it.
- A step is ``Z`` units (the global batch ``G``, or ``batch_size * W`` without one), in
  ``g = gcd(P, V)`` groups of ``Z/g`` contiguous units, group ``j`` fed by its ``P/g``
  contiguous partitions in turn: unit ``i`` of step ``s`` is group ``j = i // (Z/g)``'s
  ``n = s*Z/g + i % (Z/g)``-th unit, output ``n // (P/g)`` of partition ``j*P/g + n % (P/g)``
  (``Layout``). A rank of ``W`` (``W`` dividing ``g``) holds whole groups, so with a process
  group it reads only its ``P/W`` partitions; ranks agree on the epoch's end (the first step a
  partition cannot fill) and share what they learned of their shards in one ``all_gather`` per
  step. Without a process group (``rank=``/``world_size=`` given) a rank reads every partition.
- The position is a number of steps; the state also holds each shard read this epoch's summary
  ``[kept samples, tokens]``. A resume replays every partition's mix and buffer on unit ids from
  the summaries (``Partition.replay``), then reads only the shards that hold a unit still
  buffered and those from each stream's next unit on (``Stream.plan``): on any ``num_workers``,
  and any world size whose step divides the position.
- The inner ``DataLoader`` reads whole shards in an order the pipeline's demand picks
  (``Reader``, its sampler); the order changes only when shards are read, never what they hold.
"""

from __future__ import annotations

import heapq
import math
import pickle
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from torchrepro.data.micro import divisors
from torchrepro.data.packing import Packer
from torchrepro.data.sharded import UNITS_MARK, MixedDataset, ShardedDataset, Task, choose
from torchrepro.data.shuffle import ShuffleBuffer
from torchrepro.errors import DataLoaderStateError, LoaderConfigError
from torchrepro.seeding import Deriver, derive_seed

Summary = list[int]  # a shard's [kept samples, tokens]
Ident = tuple[int, int]  # (source, unit index in that source's stream of the partition)
END: Any = object()


class Layout:
    """Which partition feeds each unit of a step, and how many outputs a position took of each."""

    def __init__(self, partitions: int, groups: int, step: int) -> None:
        self.partitions = partitions
        self.groups = groups
        self.step = step
        self.group_units = step // groups  # Z/g
        self.group_parts = partitions // groups  # P/g

    def partition(self, step: int, unit: int) -> int:
        """The partition unit ``unit`` of step ``step`` comes from."""
        j, r = divmod(unit, self.group_units)
        n = step * self.group_units + r
        return j * self.group_parts + n % self.group_parts

    def taken(self, partition: int, consumed: int) -> int:
        """The outputs of ``partition`` the first ``consumed`` units of the sequence took."""
        j, q = divmod(partition, self.group_parts)
        s, r = divmod(consumed, self.step)
        n = s * self.group_units + min(max(r - j * self.group_units, 0), self.group_units)
        return (n - q + self.group_parts - 1) // self.group_parts if n > q else 0

    def owned(self, rank: int, world_size: int) -> range:
        """The units of a step rank ``rank`` of ``world_size`` reads (whole groups: ``W`` divides ``g``)."""
        share = self.step // world_size
        return range(rank * share, (rank + 1) * share)

    def partitions_of(self, units: range) -> list[int]:
        """The partitions that feed these units of a step (whole groups)."""
        first, last = units.start // self.group_units, (units.stop - 1) // self.group_units
        return list(range(first * self.group_parts, (last + 1) * self.group_parts))


def sources_of(dataset: ShardedDataset) -> tuple[list[ShardedDataset], list[int], list[float], str]:
    """A stream's sources, the global index of each one's first shard, weights, ``exhausted``."""
    if isinstance(dataset, MixedDataset):
        return dataset.sources, dataset.starts, dataset.weights, dataset.exhausted
    return [dataset], [0, len(dataset.shards)], [1.0], "stop"


def check_partitions(dataset: ShardedDataset, partitions: int) -> None:
    """Refuse a partition count some source has fewer shards than."""
    for a, source in enumerate(sources_of(dataset)[0]):
        if len(source.shards) < partitions:
            what = f"source {a} of the mix" if isinstance(dataset, MixedDataset) else "the dataset"
            raise LoaderConfigError(
                f"partitions={partitions} but {what} has {len(source.shards)} shards: every partition "
                "needs at least one shard of every source. Use partitions <= "
                f"{min(len(s.shards) for s in sources_of(dataset)[0])}, or split the data into more shards."
            )


def groups_for(partitions: int, micro_batches: int, world_size: int) -> int:
    """``g = gcd(P, V)``; ``LoaderConfigError`` listing the world sizes that work when ``W``
    does not divide it."""
    g = math.gcd(partitions, micro_batches)
    if g % world_size:
        raise LoaderConfigError(
            f"A stream of partitions={partitions} with {micro_batches} micro-batches per global batch "
            f"runs on the world sizes dividing both ({', '.join(map(str, divisors(g)))}), not on "
            f"{world_size}: each rank reads whole partitions for whole micro-batches. Choose partitions "
            f"and global_batch_size so that {world_size} divides both."
        )
    return g


def assignment(
    dataset: ShardedDataset, seed: int, epoch: int, partitions: int, shuffle: bool
) -> list[list[list[int]]]:
    """``[partition][source]``: the global indices of the shards that partition reads, in order."""
    sources, starts, _, _ = sources_of(dataset)
    out: list[list[list[int]]] = [[] for _ in range(partitions)]
    for a, source in enumerate(sources):
        n = len(source.shards)
        if shuffle:
            generator = torch.Generator()
            generator.manual_seed(derive_seed(seed, "shards", epoch, a))
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        dealt = (
            _balanced(order, source.lengths, partitions)
            if source.lengths
            else _round_robin(order, partitions)
        )
        for p in range(partitions):
            out[p].append([starts[a] + i for i in dealt[p]])
    return out


def _round_robin(order: list[int], partitions: int) -> list[list[int]]:
    return [order[p::partitions] for p in range(partitions)]


def _balanced(order: list[int], lengths: list[int], partitions: int) -> list[list[int]]:
    """The longest shard first, each to the partition holding the fewest samples so far (the
    lowest on a tie), then each partition's shards in ``order``: the partitions end within about
    one short shard's length of each other."""
    rank = {i: k for k, i in enumerate(order)}
    dealt: list[list[int]] = [[] for _ in range(partitions)]
    heap = [(0, p) for p in range(partitions)]
    for i in sorted(order, key=lambda i: (-lengths[i], rank[i])):
        total, p = heapq.heappop(heap)
        dealt[p].append(i)
        heapq.heappush(heap, (total + lengths[i], p))
    for shards in dealt:
        shards.sort(key=rank.__getitem__)
    return dealt


class Reader:
    """The shards of a pass: the sampler of the inner ``DataLoader`` (the next task goes to the
    stream the pipeline waits on, else to the one with the least read ahead for its weight), and
    the results handed to the streams that asked for them."""

    def __init__(self, epoch: int, fetch: Callable[[], Iterator[Any]]) -> None:
        self.epoch = epoch
        self._fetch = fetch  # the inner DataLoader's iterator, created on the first read
        self._it: Iterator[Any] | None = None
        self.streams: list[Stream] = []
        self.tasks: list[deque[tuple[int, int]]] = []
        self.weights: list[float] = []
        self.inflight: list[int] = []
        self.stashed: list[int] = []  # units read for each stream and not yet handed to it
        self.owner: dict[int, int] = {}
        self.stash: dict[int, tuple[list[Any], Summary]] = {}
        self.waiting: int | None = None
        self.units = [1, 1]  # units read, shards read: the average a shard in flight counts for
        self.news: list[tuple[int, Summary]] = []  # summaries not yet shared with the other ranks

    def register(self, stream: Stream, weight: float) -> None:
        self.owner.update({index: len(self.streams) for index in stream.shards})
        self.streams.append(stream)
        self.tasks.append(deque())
        self.weights.append(weight)
        self.inflight.append(0)
        self.stashed.append(0)

    def plan(self, stream: Stream, index: int, start: int) -> None:
        """``stream`` reads shard ``index`` (from ``start``) after those it planned before."""
        self.tasks[self.owner[index]].append((index, start))

    def __iter__(self) -> Reader:
        return self

    def __next__(self) -> Task:
        chosen = None
        if self.waiting is not None:
            s = self.owner[self.waiting]
            if self.tasks[s] and self.tasks[s][0][0] == self.waiting:
                chosen = s
        if chosen is None:
            per_shard = self.units[0] / self.units[1]
            best = math.inf
            for s, queue in enumerate(self.tasks):
                if queue:
                    ready = len(self.streams[s].queue) + self.stashed[s]
                    ahead = (ready + self.inflight[s] * per_shard) / self.weights[s]
                    if ahead < best:
                        chosen, best = s, ahead
        if chosen is None:
            raise StopIteration
        index, start = self.tasks[chosen].popleft()
        self.inflight[chosen] += 1
        return (self.epoch, index, index, start, UNITS_MARK)

    def close(self) -> None:
        """Drop the inner iterator (its workers stop, unless persistent)."""
        self._it = None
        self.stash.clear()

    def get(self, index: int) -> tuple[list[Any], Summary]:
        """Shard ``index``'s units and summary (planned before)."""
        self.waiting = index
        try:
            while index not in self.stash:
                if self._it is None:
                    self._it = self._fetch()
                try:
                    got, payload, summary = next(self._it)
                except StopIteration:
                    raise RuntimeError(
                        f"torchrepro: shard {index} was never read (a bug: please report it)"
                    ) from None
                items = pickle.loads(payload) if isinstance(payload, bytes) else payload
                self.stash[got] = (items, list(summary))
                self.inflight[self.owner[got]] -= 1
                self.stashed[self.owner[got]] += len(items)
                self.units[0] += len(items)
                self.units[1] += 1
        finally:
            self.waiting = None
        items, summary = self.stash.pop(index)
        self.stashed[self.owner[index]] -= len(items)
        return items, summary


class Stream:
    """One source's units in one partition: its shards in order, each sample (or packed block)
    numbered from 0 in the epoch.

    A resume reads it in segments: a run of consecutive shards, entered at a unit whose position
    the shards' summaries give (``plan``); the shards between segments hold no unit still wanted.
    """

    def __init__(
        self,
        source: int,
        shards: list[int],
        pack: tuple[int, str] | None,
        counts: dict[int, Summary],
        reader: Reader,
        seekable: bool,
    ) -> None:
        self.source = source
        self.shards = shards
        self.pack = pack
        self.counts = counts
        self.reader = reader
        self.seekable = seekable  # unfiltered, unpacked, and read_shard takes start: opened at a sample
        self.queue: deque[tuple[int, Any]] = deque()
        self.order: list[int] = []  # the positions (in ``shards``) to read, in order
        self.cursor = 0
        self.entries: dict[int, tuple[int, int]] = {}  # position -> (unit, skip) where a segment starts
        self.unit = 0  # the unit the next one read is
        self.skip = 0  # samples (unpacked) to drop from the shard being entered
        self.packer = Packer(*pack) if pack is not None else None

    def _units(self, kept: int, tokens: int) -> int:
        return kept if self.pack is None else tokens // self.pack[0]

    def known(self) -> tuple[int, bool]:
        """The units the summaries known account for, and whether they are all of the stream's."""
        kept = tokens = 0
        for index in self.shards:
            summary = self.counts.get(index)
            if summary is None:
                return self._units(kept, tokens), False
            kept, tokens = kept + summary[0], tokens + summary[1]
        return self._units(kept, tokens), True

    def _locate(self, item: int) -> tuple[int, int]:
        """``(position, offset)``: the shard holding item ``item`` (a sample, or a token packed)
        and its offset there, from the summaries; the first shard not known when none holds it."""
        have = 0
        column = 0 if self.pack is None else 1
        for j, index in enumerate(self.shards):
            summary = self.counts.get(index)
            if summary is None:
                if item != have:
                    raise DataLoaderStateError(
                        "The loader's position lies in a shard whose length this state does not hold; "
                        "load a state saved by this loader's state_dict()."
                    )
                return j, 0
            if item < have + summary[column]:
                return j, item - have
            have += summary[column]
        return len(self.shards), 0

    def plan(self, wanted: set[int], frontier: int) -> None:
        """Read the units in ``wanted`` and every unit from ``frontier`` on: only the shards that
        hold them, each run of consecutive ones entered at its first unit."""
        size = 1 if self.pack is None else self.pack[0]
        order: list[int] = []
        for unit in [*sorted(wanted), frontier]:
            j, skip = self._locate(unit * size)
            last = len(self.shards) - 1 if unit == frontier else self._locate((unit + 1) * size - 1)[0]
            if order and j <= order[-1] + 1:  # reading on from the run planned produces it
                order.extend(range(order[-1] + 1, min(last, len(self.shards) - 1) + 1))
                continue
            self.entries[j] = (unit, skip)
            order.extend(range(j, min(last, len(self.shards) - 1) + 1))
        self.order = order
        for j in order:
            entry = self.entries.get(j)
            start = entry[1] if entry is not None and self.seekable else 0
            self.reader.plan(self, self.shards[j], start)

    def fill(self) -> bool:
        """Whether a unit is ready (reading shards until one is, or the stream ends)."""
        while not self.queue:
            if self.cursor >= len(self.order):
                return False
            j = self.order[self.cursor]
            self.cursor += 1
            entry = self.entries.get(j)
            if entry is not None:  # a segment starts: its first unit, and where it lies in the shard
                self.unit, skip = entry
                if self.packer is not None:
                    self.packer = Packer(self.packer.seq_len, self.packer.key, skip)
                else:
                    self.skip = skip
            index = self.shards[j]
            items, summary = self.reader.get(index)
            self.counts[index] = summary
            self.reader.news.append((index, summary))
            if self.packer is None:
                read_from = self.skip if self.seekable else 0
                items = items[self.skip - read_from :] if self.skip else items
                self.skip = 0
                for sample in items:
                    self.queue.append((self.unit, sample))
                    self.unit += 1
            else:
                for tokens in items:
                    self.packer.add(tokens)
                    for block in self.packer.blocks():
                        self.queue.append((self.unit, block))
                        self.unit += 1
        return True

    def take(self) -> tuple[int, Any]:
        return self.queue.popleft()


def _known(alive: bool | None) -> bool:
    """Whether a source has a unit left, where the summaries held say (else the state is not one
    this loader saved)."""
    if alive is None:
        raise DataLoaderStateError(
            "The loader's state does not hold the lengths of the shards its position needs; load a "
            "state saved by this loader's state_dict()."
        )
    return alive


class Partition:
    """One partition's output: its sources' units, mixed by keyed draws, through its shuffle buffer."""

    def __init__(
        self,
        p: int,
        streams: list[Stream],
        weights: list[float],
        exhausted: str,
        seed: int,
        epoch: int,
        capacity: int,
    ) -> None:
        self.streams = streams
        self.weights = weights
        self.exhausted = exhausted
        self.key = Deriver(seed, ("mix", epoch, p), 4)
        self.k = 0  # mix positions drawn
        self.buffer = ShuffleBuffer(seed, epoch, capacity, partition=p)
        self.contents: dict[Ident, Any] = {}
        self.drain: Iterator[Ident] | None = None
        self.wanted: list[set[int]] = []
        self.frontier: list[int] = []

    def _draw(self, alive: Callable[[int], bool | None]) -> int | None:
        """The source of the next position (None: the stream has ended). ``alive(a)``: whether
        source ``a`` has a unit left (None: not known)."""
        n = len(self.streams)
        if n == 1:
            a = 0
        elif self.exhausted == "stop":
            a = choose(self.key.one(self.k), range(n), self.weights)
        else:
            left = [s for s in range(n) if _known(alive(s))]
            return choose(self.key.one(self.k), left, self.weights) if left else None
        return a if _known(alive(a)) else None

    def replay(self, target: int) -> None:
        """Bring the partition to ``target`` outputs from the summaries alone, and plan every
        source's reads: the units still buffered, and all from its next one (``preload`` then
        reads the buffered ones)."""
        nxt = [0] * len(self.streams)
        self._ids(nxt, target)
        buffer = self.buffer
        if buffer.emitted != target:
            raise DataLoaderStateError(
                f"The loader's state accounts for {buffer.emitted} units of a partition, not {target}; "
                "load a state saved by this loader's state_dict()."
            )
        self.wanted = [set() for _ in self.streams]
        for a, u in buffer.items:
            self.wanted[a].add(u)
        self.frontier = nxt
        for a, stream in enumerate(self.streams):
            stream.plan(self.wanted[a], nxt[a])

    def _ids(self, nxt: list[int], target: int | None) -> None:
        """Run the mix and the buffer on unit ids (``nxt``: each source's next unit) until
        ``target`` outputs (None: the end), from the summaries known."""
        known = [s.known() for s in self.streams]

        def alive(a: int) -> bool | None:
            units, complete = known[a]
            return True if nxt[a] < units else (False if complete else None)

        buffer = self.buffer
        while (target is None or buffer.emitted < target) and self.drain is None:
            a = self._draw(alive)
            if a is None:
                self.drain = buffer.drain()
                break
            buffer.push((a, nxt[a]))
            nxt[a] += 1
            self.k += 1
        if self.drain is not None:
            for _ in self.drain:
                if buffer.emitted == target:
                    break

    def count_to_end(self) -> tuple[int, bool]:
        """From a replayed position: the outputs the partition gives in its epoch and True, or,
        when the summaries known do not reach its end, as many as they account for and False."""
        try:
            self._ids(list(self.frontier), None)
        except DataLoaderStateError:
            return self.buffer.emitted + len(self.buffer.items), False
        return self.buffer.emitted, True

    def preload(self) -> None:
        """Read the units the replayed buffer holds; every source then stands at its next unit.
        (After every partition's ``replay``: the shards of all of them are planned by then.)"""
        nxt = self.frontier
        for a, stream in enumerate(self.streams):
            want = self.wanted[a]
            while want or (stream.fill() and stream.queue[0][0] < nxt[a]):
                if not stream.fill():
                    raise DataLoaderStateError(
                        "A shard holds fewer units than this loader's state says; the data changed since "
                        "the state was saved."
                    )
                u, sample = stream.take()
                if u in want:
                    self.contents[(a, u)] = sample
                    want.discard(u)

    def next(self) -> Any:
        """The partition's next output, or ``END``."""
        while True:
            if self.drain is not None:
                out = next(self.drain, END)
                return out if out is END else self.contents.pop(out)
            a = self._draw(lambda s: self.streams[s].fill())
            if a is None:
                self.drain = self.buffer.drain()
                continue
            u, sample = self.streams[a].take()
            self.k += 1
            ident = (a, u)
            self.contents[ident] = sample
            out = self.buffer.push(ident)
            if out is not None:
                return self.contents.pop(out)


def build(
    dataset: ShardedDataset,
    seed: int,
    epoch: int,
    partitions: int,
    shuffle: bool,
    capacity: int,
    counts: dict[int, Summary],
    reader: Reader,
    mine: Sequence[int],
) -> dict[int, Partition]:
    """The partitions in ``mine`` of epoch ``epoch``, at their start (``replay`` moves them on)."""
    sources, _, weights, exhausted = sources_of(dataset)
    dealt = assignment(dataset, seed, epoch, partitions, shuffle)
    out = {}
    for p in mine:
        streams = []
        for a, source in enumerate(sources):
            stream = Stream(
                a,
                dealt[p][a],
                source._pack,
                counts,
                reader,
                source.takes_start and not source._filters and source._pack is None,
            )
            reader.register(stream, weights[a] / len(mine))
            streams.append(stream)
        out[p] = Partition(p, streams, weights, exhausted, seed, epoch, capacity)
    return out


def agree(ok: bool, news: list[tuple[int, Summary]]) -> tuple[bool, list[tuple[int, Summary]]]:
    """Every rank's ``ok`` (all filled their part of the step) and the shard summaries they read."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ok, news))
    return all(g[0] for g in gathered), [item for g in gathered for item in g[1]]
