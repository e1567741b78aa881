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
"""

from __future__ import annotations

import inspect
import io
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchrepro._compat import numpy_or_none
from torchrepro.data.rawrng import _python_mt, numpy_mt
from torchrepro.data.view import _active
from torchrepro.data.watch import Watch, _changed, rng_tokens
from torchrepro.errors import ShardReadError
from torchrepro.seeding import TORCH_RNG, Deriver, derive_seed, sample_seeder

__all__ = ["ShardedDataset"]

TASK_MARK: Final = 0x5A4D5EED
Task = tuple[int, int, int, int, int]  # (epoch, shard index, shard position in the epoch, start, mark)


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
    lengths may be unequal and unknown, and a shard may be empty. When ``read_shard`` accepts a
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

    def __init__(self, shards: Iterable[Any], read_shard: Callable[..., Iterable[Any]]) -> None:
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

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        mine = range(len(self.shards)) if info is None else range(info.id, len(self.shards), info.num_workers)
        for index in mine:
            yield from self._open(index, 0)

    def _open(self, index: int, start: int) -> Iterator[Any]:
        shard = self.shards[index]
        try:
            if start and self.takes_start:
                return iter(self.read_shard(shard, start))
            return iter(self.read_shard(shard))
        except Exception as e:
            raise ShardReadError(_failed(index, shard, e)) from e

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
        offset = start if (start and self.takes_start) else 0
        samples: list[tuple[int, Any]] = []
        shard = self.shards[index]
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
                if offset >= start:
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

    def __getitem__(self, task: Task) -> tuple[int, list[tuple[int, Any]] | bytes, int]:
        epoch, index, position, start, mark = task
        if mark != TASK_MARK:
            raise TypeError("a streaming SeededLoader's inner dataset is indexed by its own tasks only")
        if get_worker_info() is not None:
            samples, length = self.source.read(self.seed, epoch, index, start)
            return position, _pack(samples), length
        np = numpy_or_none()
        saved = (_python_mt.save(), numpy_mt.save(np) if np is not None else None, torch.get_rng_state())
        try:
            samples, length = self.source.read(self.seed, epoch, index, start)
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


def _pack(samples: list[tuple[int, Any]]) -> bytes:
    out = io.BytesIO()
    _Packer(out, protocol=pickle.HIGHEST_PROTOCOL).dump(samples)
    return out.getvalue()


def as_is(result: Any) -> Any:
    """The inner loader's ``collate_fn``: a shard's result passes through unchanged."""
    return result
