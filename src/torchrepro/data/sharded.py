"""``ShardedDataset``: a stream of shards, and how a shard is read seeded per sample.

Invariants:
- A shard is whatever the user's ``read_shard(shard)`` (or ``read_shard(shard, start)``) turns
  into an iterator of samples; the dataset only holds the list and the function.
- Sample ``o`` of shard ``i`` (its index in the list the user gave) in epoch ``e`` is read with
  Python ``random``, NumPy's global RNG and torch's CPU RNG seeded from
  ``derive_seed(seed, "sample", e, i, o)`` just before the iterator is asked for it (the code a
  generator runs for a sample runs inside that ``next()``), and ``sample_rng()`` keyed the same:
  which worker reads a shard, and when, changes nothing.
- Reading from ``start`` uses ``read_shard(shard, start)`` when the function takes a second
  argument, else reads the shard from its beginning and drops the first ``start`` samples (each
  still seeded by its own offset, so the kept ones are the same).
- A shard that fails to open or to read raises ``ShardReadError`` naming it, from the worker
  that read it; a shard's length is what reading it to its end found.
- ``filter``, ``pack`` and ``mix`` return new datasets over the same shards and never change the
  one they were called on. A predicate runs right after its sample is read, under that sample's
  seeding, in the worker that read it: what it keeps is a function of the sample's key. Packing
  and mixing happen in the loader (``data.partitions``), which this module only describes: the
  pack spec, the mix's sources and weights.
"""

from __future__ import annotations

import bisect
import copy
import inspect
import io
import math
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchrepro._compat import numpy_or_none
from torchrepro.data.packing import Packer, tokens_of
from torchrepro.data.rawrng import _python_mt, numpy_mt
from torchrepro.data.view import _active
from torchrepro.data.watch import Watch, _changed, rng_tokens
from torchrepro.errors import LoaderConfigError, ShardReadError
from torchrepro.seeding import TORCH_RNG, Deriver, derive_seed, sample_seeder

__all__ = ["MixedDataset", "ShardedDataset"]

TASK_MARK: Final = 0x5A4D5EED
UNITS_MARK: Final = 0x5A4D5EEE  # a task of a partitioned stream (``ShardTasks.__getitem__``)
Task = tuple[int, int, int, int, int]  # (epoch, shard index, shard position in the epoch, start, mark)

EXHAUSTED = ("stop", "skip")
"""What a mix does when the source it drew for a position has no sample left: ``"stop"`` ends the
stream there (the proportions hold to its end), ``"skip"`` draws again among the sources left."""


def _takes_start(read_shard: Callable[..., Any]) -> bool:
    """Whether ``read_shard`` accepts a second positional argument (the offset to start at)."""
    try:
        params = list(inspect.signature(read_shard).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


class ShardedDataset(IterableDataset[Any]):
    """A dataset streamed from shards: ``read_shard(shard)`` yields the samples of one shard.

    ``shards`` is a list of anything ``read_shard`` takes (file paths, URLs, indices); their
    lengths may be unequal and unknown, and a shard may be empty. ``lengths`` (samples per shard,
    when known, e.g. from Parquet metadata) lets a partitioned loader deal the shards to its
    partitions evenly, so an epoch, which ends where a partition runs out, leaves less behind.
    When ``read_shard`` accepts a
    second argument, ``read_shard(shard, start)`` must yield the samples from offset ``start``
    (a resume then opens the shard there); otherwise a resume reads the shard from its start and
    skips (the skipped samples are read, at their cost, and dropped).

    Through ``torchrepro.SeededLoader(dataset, batch_size=..., seed=..., shuffle_buffer=N)`` the
    sequence of samples of an epoch, and every sample's randomness, is a function of (seed,
    epoch) only: the same for any ``num_workers`` and world size, and a state saved mid-epoch
    resumes on another worker count or world size. Iterated directly (or by a plain
    ``DataLoader``) it is an ordinary ``IterableDataset``: each worker reads every
    ``num_workers``-th shard, unseeded, as most streaming datasets do.

    >>> ds = ShardedDataset([3, 1, 2], lambda n: iter(range(n)))
    >>> list(ds)
    [0, 1, 2, 0, 0, 1]
    """

    _tr_loader: type | None = None  # set by data.streaming: the SeededLoader class that streams it

    def __init__(
        self,
        shards: Iterable[Any],
        read_shard: Callable[..., Iterable[Any]],
        lengths: Sequence[int] | None = None,
    ) -> None:
        if isinstance(shards, (str, bytes)) or not isinstance(shards, Iterable):
            raise TypeError(
                f"ShardedDataset needs a list of shards (e.g. sorted(glob('data/*.jsonl'))), got "
                f"{type(shards).__name__} {shards!r:.80}."
            )
        self.shards = list(shards)
        if not self.shards:
            raise ValueError("ShardedDataset got no shards: pass at least one (check the glob pattern).")
        if not callable(read_shard):
            raise TypeError(
                f"read_shard must be callable (shard -> iterator of samples), got {read_shard!r:.80}."
            )
        self.read_shard = read_shard
        self.takes_start = _takes_start(read_shard)
        if lengths is not None:
            lengths = list(lengths)
            if len(lengths) != len(self.shards) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths
            ):
                raise ValueError(
                    f"lengths must give each of the {len(self.shards)} shards its number of samples (an int "
                    f">= 0), got {lengths!r:.120}."
                )
        self.lengths = lengths
        self._filters: tuple[Callable[[Any], Any], ...] = ()
        self._pack: tuple[int, str] | None = None  # (seq_len, key)

    @classmethod
    def from_hf(cls, streaming_dataset: Any) -> ShardedDataset:
        """The shards of a Hugging Face ``datasets.IterableDataset`` (``streaming=True``, or
        ``Dataset.to_iterable_dataset(num_shards=...)``): shard ``i`` is
        ``streaming_dataset.shard(num_shards=n_shards, index=i)``. Its own shuffling is not used:
        the loader decides the order (``shuffle_buffer=``)."""
        n_shards = getattr(streaming_dataset, "n_shards", None)
        if not isinstance(n_shards, int) or not callable(getattr(streaming_dataset, "shard", None)):
            raise TypeError(
                "ShardedDataset.from_hf needs a datasets.IterableDataset (with n_shards and shard()), got "
                f"{type(streaming_dataset).__name__}; for a map-style datasets.Dataset use SeededLoader "
                "directly, or .to_iterable_dataset(num_shards=...) to stream it."
            )
        return cls(range(n_shards), _HFShard(streaming_dataset, n_shards))

    @classmethod
    def from_parquet(
        cls,
        paths: Iterable[str | os.PathLike[str]],
        columns: Iterable[str] | None = None,
        *,
        shard_by: str = "file",
    ) -> ShardedDataset:
        """Parquet files (needs pyarrow: ``pip install torchrepro[parquet]``): a shard is a file,
        or with ``shard_by="row_group"`` one row group of a file (the ``(path, row_group)`` pairs
        are read from the files' metadata now). A sample is a row, a dict column -> value for
        ``columns`` (all when ``None``): a column of lists of integers (token ids) gives a 1-D
        ``torch.int64`` tensor, any other value the Python value pyarrow gives (``to_pylist``).
        A resume skips the row groups before its start unread. A file without one of
        ``columns`` is an error naming the columns it has."""
        from torchrepro.data import formats

        shards, reader, lengths = formats.parquet_shards(paths, columns, shard_by=shard_by)
        return cls(shards, reader, lengths)

    @classmethod
    def from_tar(
        cls,
        paths: Iterable[str | os.PathLike[str]],
        *,
        decode: Mapping[str, Callable[[bytes], Any]] | Callable[[dict[str, Any]], Any] | None = None,
    ) -> ShardedDataset:
        """WebDataset-style tar files (plain or compressed), one shard per file, read as a stream.
        Members are grouped by key (the name up to the first dot of the base name, directory
        included); a sample is ``{"__key__": key, extension: bytes, ...}`` (extensions in lower
        case, without the dot) for each run of members with one key, in archive order.
        ``decode`` maps extensions to functions of the bytes (``{"json": json.loads, "txt":
        bytes.decode, "cls": int}``; other extensions stay bytes), or is a function of the sample
        dict; it runs seeded with the sample. A resume reads past the members before its start
        in that one shard (a tar has no index)."""
        from torchrepro.data import formats

        return cls(*formats.tar_shards(paths, decode))

    @classmethod
    def from_jsonl(
        cls, paths: Iterable[str | os.PathLike[str]], *, encoding: str = "utf-8"
    ) -> ShardedDataset:
        """JSON Lines files, one shard per file (``.gz`` files read through gzip): a sample is the
        JSON value of a non-blank line (``json.loads``: a dict for an object). A resume skips the
        lines before its start without decoding them; a line that is not valid JSON is an error
        naming the file and the line number."""
        from torchrepro.data import formats

        return cls(*formats.jsonl_shards(paths, encoding))

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    # -- transforms -------------------------------------------------------------------------

    def filter(self, predicate: Callable[[Any], Any]) -> ShardedDataset:
        """The samples for which ``predicate(sample)`` is true; a new dataset (this one is unchanged).

        The predicate runs in the worker that read the sample, right after reading it, with the
        global RNGs and ``sample_rng()`` still seeded by the sample's key: a predicate that draws
        (``random.random() < 0.1`` to subsample) keeps the same samples on any ``num_workers``,
        world size or resume. Filters chain (``ds.filter(f).filter(g)``); filter documents before
        ``pack``. Through ``SeededLoader`` a filtered stream is partitioned (``partitions=``, 1 by
        default); a resume re-reads from its start each shard that still holds buffered samples
        (which offsets were kept is known only by reading).
        """
        if not callable(predicate):
            raise TypeError(f"filter needs a callable sample -> bool, got {predicate!r:.80}.")
        if self._pack is not None:
            raise LoaderConfigError(
                "filter() after pack() would filter packed blocks, whose documents were already cut: "
                "filter the documents first, ds.filter(keep).pack(seq_len)."
            )
        out = self._copy()
        out._filters = (*self._filters, predicate)
        return out

    def pack(self, seq_len: int, key: str = "input_ids") -> ShardedDataset:
        """Documents concatenated and cut into blocks of exactly ``seq_len`` tokens; a new dataset.

        Each sample must be a mapping whose ``key`` holds a 1-D sequence of token ids (a list, a
        NumPy array or a tensor). Through ``SeededLoader`` the documents of each partition's stream
        (its shards in order, after filters) are concatenated and cut; a block may span documents
        and shards. Each packed sample is ``{key: tokens, "position_ids": ..., "document_ids":
        ...}``, three 1-D tensors of ``seq_len``: ``position_ids`` is each token's position in
        its document (0 where a document starts; a document continued from the previous block
        continues its count), ``document_ids`` numbers the documents within the block from 0 (for
        block-diagonal attention masks). The other fields of a document are dropped. Only the
        tokens after the last whole block of a partition's stream are dropped; empty documents
        contribute nothing. Blocks go through the shuffle buffer (documents stay in stream order
        within a block).
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"pack needs seq_len to be a positive int (tokens per block), got {seq_len!r}.")
        if not isinstance(key, str):
            raise TypeError(f"pack needs key to be the name of the token field (a str), got {key!r:.80}.")
        if self._pack is not None:
            raise LoaderConfigError(f"This dataset is already packed (seq_len={self._pack[0]}); pack once.")
        out = self._copy()
        out._pack = (seq_len, key)
        return out

    @classmethod
    def mix(
        cls,
        datasets: Sequence[ShardedDataset],
        weights: Sequence[float] | None = None,
        *,
        exhausted: str = "stop",
    ) -> MixedDataset:
        """A stream that takes each position from one of ``datasets``, chosen by a keyed draw.

        Through ``SeededLoader``, position ``k`` of partition ``p``'s stream in epoch ``e`` draws
        its source from ``derive_seed(seed, "mix", e, p, k)`` with probabilities proportional to
        ``weights`` (equal by default): the proportions hold in expectation, and the choices are
        the same for any ``num_workers``, world size or resume. Each source's shards are dealt to
        the partitions separately, so every source needs at least ``partitions`` shards. When the
        source drawn for a position has run out: ``exhausted="stop"`` (default) ends that
        partition's stream there (the proportions hold to the end; what the other sources still
        hold waits for the next epoch), ``exhausted="skip"`` draws among the sources left (the
        stream ends with the last one; its tail has other proportions). The sources' filters and
        packing are kept; all must be packed alike or not at all. The mix lists its sources'
        shards one after another, and a sample's key names its shard's index in that list.
        """
        if isinstance(datasets, ShardedDataset) or not isinstance(datasets, Sequence) or not datasets:
            raise TypeError(
                "ShardedDataset.mix needs a non-empty list of ShardedDatasets, e.g. "
                "ShardedDataset.mix([web, code], weights=[0.7, 0.3])."
            )
        for i, d in enumerate(datasets):
            if not isinstance(d, ShardedDataset):
                raise TypeError(
                    f"ShardedDataset.mix: source {i} is a {type(d).__name__}, not a ShardedDataset."
                )
            if isinstance(d, MixedDataset):
                raise LoaderConfigError(
                    f"ShardedDataset.mix: source {i} is itself a mix; mix the sources in one call "
                    "with their weights multiplied out."
                )
        if weights is None:
            weights = [1.0] * len(datasets)
        weights = [float(w) for w in weights] if isinstance(weights, Sequence) else weights
        if (
            not isinstance(weights, list)
            or len(weights) != len(datasets)
            or not all(math.isfinite(w) and w > 0 for w in weights)
        ):
            raise ValueError(
                f"ShardedDataset.mix needs one positive finite weight per source ({len(datasets)}), got "
                f"{weights!r:.200}."
            )
        if exhausted not in EXHAUSTED:
            raise ValueError(f"exhausted must be one of {EXHAUSTED}, got {exhausted!r}.")
        packs = {d._pack for d in datasets}
        if len(packs) > 1:
            raise LoaderConfigError(
                f"ShardedDataset.mix: the sources are packed differently ({sorted(map(str, packs))}); "
                "pack every source with the same seq_len and key, or none (then pack the mix)."
            )
        return MixedDataset(list(datasets), weights, exhausted)

    def _copy(self) -> ShardedDataset:
        out = copy.copy(self)
        out.__dict__.pop("_tr_watch", None)
        return out

    @property
    def transformed(self) -> bool:
        """Whether this stream is filtered, packed or mixed (and so always partitioned)."""
        return bool(self._filters) or self._pack is not None

    def _filters_for(self, index: int) -> tuple[Callable[[Any], Any], ...]:
        """The filters of the source that shard ``index`` belongs to."""
        return self._filters

    @property
    def packing(self) -> tuple[int, str] | None:
        """``(seq_len, key)`` when packed, else None."""
        return self._pack

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        mine = range(len(self.shards)) if info is None else range(info.id, len(self.shards), info.num_workers)
        samples = (sample for index in mine for sample in self._open(index, 0))
        if self._filters:
            samples = (x for x in samples if all(f(x) for f in self._filters))
        if self._pack is not None:
            seq_len, key = self._pack
            packer = Packer(seq_len, key)
            for sample in samples:
                packer.add(tokens_of(sample, key))
                yield from packer.blocks()
            return
        yield from samples

    def _open(self, index: int, start: int) -> Iterator[Any]:
        shard = self.shards[index]
        try:
            if start and self.takes_start:
                return iter(self.read_shard(shard, start))
            return iter(self.read_shard(shard))
        except Exception as e:
            raise ShardReadError(_failed(index, shard, e)) from e

    def _starts_at(self, index: int) -> bool:
        """Whether shard ``index`` can be opened at an offset (its ``read_shard`` takes ``start``)."""
        return self.takes_start

    def read_units(self, seed: int, epoch: int, index: int, start: int) -> tuple[list[Any], list[int]]:
        """Shard ``index`` as a partitioned stream's units: its kept samples from kept index
        ``start`` (``start`` > 0 only for an unfiltered shard, where a kept index is an offset),
        or, packed, each kept document's tokens; and the shard's summary ``[kept samples,
        tokens]`` (tokens 0 unpacked)."""
        samples, length = self.read(seed, epoch, index, start)
        pack = self._pack
        if pack is None:
            kept = length if start else len(samples)
            return [sample for _, sample in samples], [kept, 0]
        tokens = [tokens_of(sample, pack[1], index, offset) for offset, sample in samples]
        return tokens, [len(tokens), sum(len(t) for t in tokens)]

    def read(self, seed: int, epoch: int, index: int, start: int) -> tuple[list[tuple[int, Any]], int]:
        """Shard ``index`` from offset ``start``, every sample read seeded from its key:
        ``([(offset, sample), ...], the shard's length)``.

        Seeding Python's and NumPy's global RNGs costs more per sample than torch's, and most
        ``read_shard`` functions draw from one or none of them: torch's RNG is seeded per sample,
        and so are those this process has seen the function draw from; the others are seeded once
        for the shard and checked after it. If the shard drew from one, it is read again with that
        RNG seeded per sample too (once per RNG and process). Either way every sample saw exactly
        the draws it sees when all three are seeded per sample.
        """
        np = numpy_or_none()
        watch = self.__dict__.get("_tr_watch")
        if watch is None:
            watch = self._tr_watch = Watch()
        while True:
            once = watch.available & ~watch.drawn
            result = self._read_seeded(
                seed, epoch, index, start, np, (watch.drawn & watch.available) | TORCH_RNG, once
            )
            if isinstance(result, int):  # the shard drew from an RNG seeded once: again
                watch.drawn |= result
                continue
            return result

    def _read_seeded(
        self, seed: int, epoch: int, index: int, start: int, np: Any, per_sample: int, once: int
    ) -> tuple[list[tuple[int, Any]], int] | int:
        """``read``'s work with the RNGs in ``per_sample`` seeded per sample and those in ``once``
        seeded once for the shard; the RNGs of ``once`` the shard drew from, if any."""
        before = None
        if once:
            sample_seeder(np, once)(derive_seed(seed, "shard", epoch, index))
            before = rng_tokens(once, np)
        seed_globals = sample_seeder(np, per_sample)
        key = Deriver(seed, ("sample", epoch, index), 4)
        active = _active
        outer = (active.seed, active.rng)
        offset = start if (start and self._starts_at(index)) else 0
        samples: list[tuple[int, Any]] = []
        shard = self.shards[index]
        filters = self._filters_for(index)
        keys: list[int] = []
        keys_from = offset
        try:
            s = key.one(offset)
            seed_globals(s)  # opening the shard may draw too: it does so as sample `offset`
            active.seed, active.rng = s, None
            it = self._open(index, start)
            while True:
                if offset - keys_from >= len(keys):  # keys derived 64 at a time (a third the cost)
                    keys_from, keys = offset, key.many(range(offset, offset + 64))
                s = keys[offset - keys_from]
                seed_globals(s)
                active.seed, active.rng = s, None
                try:
                    sample = next(it)
                except StopIteration:
                    break
                if offset >= start and (not filters or all(f(sample) for f in filters)):
                    samples.append((offset, sample))
                offset += 1
        except ShardReadError:
            raise
        except Exception as e:
            raise ShardReadError(_failed(index, shard, e, offset)) from e
        finally:
            active.seed, active.rng = outer
        if before is not None:
            disturbed = _changed(once, before, np)
            if disturbed:
                return disturbed
        return samples, offset


class MixedDataset(ShardedDataset):
    """``ShardedDataset.mix(sources, weights, exhausted=...)``: the sources' shards in one list
    (source ``a``'s shard ``i`` is shard ``starts[a] + i``), each read by its own source with its
    own filters. Iterated directly it draws its sources with seed 0 (a SeededLoader keys them by
    its seed, epoch and partition)."""

    def __init__(self, sources: list[ShardedDataset], weights: list[float], exhausted: str) -> None:
        self.sources = sources
        self.weights = weights
        self.exhausted = exhausted
        self.starts = [0]
        for source in sources:
            self.starts.append(self.starts[-1] + len(source.shards))
        self.shards = [shard for source in sources for shard in source.shards]
        self.read_shard = self._read_global
        self.takes_start = False
        self.lengths = None  # each source deals its own shards
        self._filters = ()
        self._pack = sources[0]._pack

    def source_of(self, index: int) -> tuple[int, int]:
        """``(source, its shard index)`` of global shard ``index``."""
        a = bisect.bisect_right(self.starts, index) - 1
        return a, index - self.starts[a]

    def _read_global(self, index: int) -> Iterable[Any]:
        a, local = self.source_of(index)
        return self.sources[a].read_shard(self.sources[a].shards[local])

    def _open(self, index: int, start: int) -> Iterator[Any]:
        a, local = self.source_of(index)
        return self.sources[a]._open(local, start)

    def _starts_at(self, index: int) -> bool:
        a, _ = self.source_of(index)
        return self.sources[a].takes_start

    def _filters_for(self, index: int) -> tuple[Callable[[Any], Any], ...]:
        a, _ = self.source_of(index)
        return self.sources[a]._filters

    @property
    def transformed(self) -> bool:
        return True

    def filter(self, predicate: Callable[[Any], Any]) -> ShardedDataset:
        """Every source filtered by ``predicate`` (see ``ShardedDataset.filter``)."""
        return MixedDataset([s.filter(predicate) for s in self.sources], self.weights, self.exhausted)

    def pack(self, seq_len: int, key: str = "input_ids") -> ShardedDataset:
        """Every source packed (see ``ShardedDataset.pack``): blocks hold one source's documents,
        and the mix draws blocks."""
        return MixedDataset([s.pack(seq_len, key) for s in self.sources], self.weights, self.exhausted)

    def __iter__(self) -> Iterator[Any]:
        streams: dict[int, Iterator[Any]] = {a: iter(s) for a, s in enumerate(self.sources)}
        draw = Deriver(0, ("mix", 0, 0), 4)
        k = 0
        while streams:
            alive = sorted(streams) if self.exhausted == "skip" else list(range(len(self.sources)))
            a = choose(draw.one(k), alive, self.weights)
            k += 1
            sample = next(streams[a], _END) if a in streams else _END
            if sample is not _END:
                yield sample
            elif self.exhausted == "stop":
                return
            else:
                del streams[a]
                k -= 1  # the position is drawn again among the sources left


_END = object()


def choose(key: int, alive: Sequence[int], weights: Sequence[float]) -> int:
    """The source a draw ``key`` (64 bits) picks among ``alive``, by their weights."""
    u = (key >> 11) * 2.0**-53
    total = math.fsum(weights[a] for a in alive)
    acc = 0.0
    for a in alive:
        acc += weights[a] / total
        if u < acc:
            return a
    return alive[-1]


def _failed(index: int, shard: Any, error: BaseException, offset: int | None = None) -> str:
    where = "opening it" if offset is None else f"reading sample {offset}"
    return (
        f"Shard {index} ({shard!r:.200}) failed while {where}: {type(error).__name__}: {error}. "
        "Check that the shard exists and is readable, or remove it from the shard list."
    )


class _HFShard:
    """``read_shard`` for a Hugging Face streaming dataset: shard ``i`` of ``n``."""

    def __init__(self, dataset: Any, n_shards: int) -> None:
        self.dataset = dataset
        self.n_shards = n_shards

    def __call__(self, index: int) -> Iterator[Any]:
        # ``iter(batch_size=1)``, not ``__iter__``: inside a DataLoader worker ``__iter__`` would
        # split the shard again among the workers (datasets' own worker sharding).
        shard = self.dataset.shard(num_shards=self.n_shards, index=index)
        for batch in shard.iter(batch_size=1):
            yield {key: value[0] for key, value in batch.items()}


class ShardTasks(torch.utils.data.Dataset[Any]):
    """What the inner ``DataLoader`` of a streaming ``SeededLoader`` loads: a task is one shard
    from an offset, and its result that shard's samples (``ShardedDataset.read``). In the main
    process the global RNG states are put back after each shard."""

    def __init__(self, dataset: ShardedDataset, seed: int) -> None:
        self.source = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.source.shards)

    def __getitem__(self, task: Task) -> tuple[int, Any, Any]:
        epoch, index, position, start, mark = task
        if mark not in (TASK_MARK, UNITS_MARK):
            raise TypeError("a streaming SeededLoader's inner dataset is indexed by its own tasks only")
        read = self.source.read if mark == TASK_MARK else self.source.read_units
        if get_worker_info() is not None:
            samples, length = read(self.seed, epoch, index, start)
            return position, _pack(samples), length
        np = numpy_or_none()
        saved = (_python_mt.save(), numpy_mt.save(np) if np is not None else None, torch.get_rng_state())
        try:
            samples, length = read(self.seed, epoch, index, start)
        finally:
            _python_mt.restore(saved[0])
            if np is not None:
                numpy_mt.restore(np, saved[1])
            torch.set_rng_state(saved[2])
        return position, samples, length


# A shard's samples leave a worker as one pickled buffer. Handed over as they are, its many small
# tensors would each go through a shared-memory segment of their own, and pickled plainly each
# through torch.save's machinery (each about 80 us: a third of the throughput at 50 samples of
# 100 us, measured); as NumPy arrays they pickle at memory speed and come back as the same tensors.
_NUMPY_DTYPES = {
    torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.bool, torch.complex64, torch.complex128,
}  # fmt: skip


_HAS_NUMPY = numpy_or_none() is not None  # without NumPy tensors pickle the ordinary way


def _tensor_from_numpy(array: Any) -> torch.Tensor:
    return torch.from_numpy(array)


class _Packer(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and _HAS_NUMPY
            and obj.device.type == "cpu"
            and obj.layout is torch.strided
            and not obj.requires_grad
            and obj.dtype in _NUMPY_DTYPES
            and not obj.is_conj()
            and not obj.is_neg()
        ):
            return _tensor_from_numpy, (obj.numpy(),)
        return NotImplemented


def _pack(samples: list[Any]) -> bytes:
    out = io.BytesIO()
    _Packer(out, protocol=pickle.HIGHEST_PROTOCOL).dump(samples)
    return out.getvalue()


def as_is(result: Any) -> Any:
    """The inner loader's ``collate_fn``: a shard's result passes through unchanged."""
    return result
