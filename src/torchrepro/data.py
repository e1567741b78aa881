"""Seeded data loading: batches that depend only on (seed, epoch), never on how they are loaded.

Invariants:
- The order of epoch ``e`` is a pure function of ``(seed, e)``, drawn from the loader's own
  ``torch.Generator`` seeded with ``derive_seed(seed, "order", e)``; every rank draws the same
  permutation and takes its own shard. Nothing here draws from a global RNG.
- Sample ``i`` of epoch ``e`` is loaded with Python ``random``, NumPy's global RNG and torch's
  CPU RNG seeded from ``derive_seed(seed, "sample", e, i)`` (and ``sample_rng()`` keyed the same);
  ``collate_fn`` runs seeded from ``derive_seed(seed, "batch", e, b)``. Which process or worker
  loads a sample, and when, therefore changes nothing: batches are bitwise identical for any
  ``num_workers``, ``persistent_workers``, ``prefetch_factor``, start method or ``pin_memory``.
- In the main process (``num_workers=0``) the global RNG states are put back after every batch,
  so loading never moves the training loop's RNG stream.
- The position is the number of batches the training loop *received* in the current epoch (not
  what workers prefetched) and whether that pass ended; resuming skips by index, without loading
  the skipped samples. A state saved inside a pass, even after its last batch, resumes into the
  rest of that epoch (possibly empty), so code after the loop's inner ``for`` runs once.
- The parts are self-sufficient: the sampler (a ``DistributedSampler``) holds the position and
  reads rank and world size when each pass starts; ``loader.dataset`` is a view of the user's
  dataset that does the seeding; ``collate_fn`` unwraps what it collated. A framework that
  rebuilds a plain ``DataLoader`` from these parts gets the same batches.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, MutableSet, Sequence
from typing import Any, Final

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from torchrepro._compat import generator_set, numpy_or_none, require_numpy
from torchrepro._rawrng import _numpy_mt, _python_mt
from torchrepro._runtime import process_group
from torchrepro.errors import DataLoaderStateError, LoaderConfigError, UnsupportedDatasetError
from torchrepro.seeding import (
    _PERSON,
    NUMPY_RNG,
    PYTHON_RNG,
    TORCH_RNG,
    _encode_key,
    current_seed,
    derive_seed,
    sample_seeder,
    validate_seed,
)

__all__ = ["LoaderConfigError", "SeededLoader", "UnsupportedDatasetError", "sample_rng"]

STATE_VERSION: Final = 1
"""Version of the dict ``SeededLoader.state_dict()`` returns."""


# --------------------------------------------------------------------------------------------
# Seeds: derive_seed(seed, *prefix, *rest) from a copied hash state (the per-sample hot path).


class _Deriver:
    """``derive_seed(seed, *prefix, *rest)`` for a fixed prefix, at the cost of one hash copy.

    Produces exactly ``derive_seed``'s value (a test checks it): the hash state after the seed,
    the key count and the prefix keys is computed once and copied for every call.
    """

    __slots__ = ("_hash",)

    def __init__(self, seed: int, prefix: tuple[int | str, ...], n_keys: int) -> None:
        h = hashlib.blake2b(digest_size=8, person=_PERSON)
        h.update(seed.to_bytes(8, "little"))
        h.update(struct.pack("<I", n_keys))
        for key in prefix:
            h.update(_encode_key(key))
        self._hash = h

    def __call__(self, *rest: int | str) -> int:
        h = self._hash.copy()
        for key in rest:
            h.update(_encode_key(key))
        return int.from_bytes(h.digest(), "little")

    def one(self, key: int) -> int:
        """``self(key)`` for one int key (through ``many``)."""
        return self.many((key,))[0]

    def many(self, keys: Iterable[int]) -> list[int]:
        """``[self(key) for key in keys]`` for int keys (the per-sample hot path: one call per
        batch, ``_encode_key``'s header looked up for lengths up to 8 bytes)."""
        base, heads, pack, from_bytes = self._hash, _INT_HEADS, _pack_u32, int.from_bytes
        seeds: list[int] = []
        append = seeds.append
        for key in keys:
            h = base.copy()
            length = (key.bit_length() + 8) >> 3  # room for the sign bit
            head = heads[length] if length < len(heads) else b"i" + pack(length)
            h.update(head + key.to_bytes(length, "little", signed=True))
            append(from_bytes(h.digest(), "little"))
        return seeds


_pack_u32 = struct.Struct("<I").pack
_INT_HEADS = tuple(b"i" + _pack_u32(length) for length in range(9))  # _encode_key's type and length


# --------------------------------------------------------------------------------------------
# Global RNG seeding, and the generator sample_rng() returns.

_np: Any = None  # numpy, resolved on first use (it is optional)
_np_resolved = False


def _numpy() -> Any:
    global _np, _np_resolved
    if not _np_resolved:
        _np = numpy_or_none()
        _np_resolved = True
    return _np


class _Active:
    """What ``sample_rng()`` is keyed by right now (the sample or batch being loaded)."""

    __slots__ = ("rng", "seed")

    def __init__(self) -> None:
        self.seed: int | None = None
        self.rng: Any = None


_active = _Active()


def sample_rng() -> Any:
    """The ``numpy.random.Generator`` of the sample being loaded by a ``SeededLoader``.

    Call it inside your dataset's ``__getitem__``: it is ``numpy.random.default_rng(
    derive_seed(seed, "sample", epoch, index))``, created on the first call for each sample and
    returned again by later calls for the same sample (so two calls never repeat draws). Its
    draws depend only on (seed, epoch, index), not on the worker that loads the sample, and never
    repeat across samples or epochs. Inside ``collate_fn`` it is keyed by
    ``(seed, "batch", epoch, batch_index)``. Outside a ``SeededLoader`` it raises ``ReproError``.

    Unlike an RNG object made in ``__init__`` (which every worker gets a copy of), this one is
    correct for any ``num_workers``.
    """
    active = _active
    if active.seed is None:
        raise LoaderConfigError(
            "sample_rng() was called outside a sample being loaded by a SeededLoader; it is keyed "
            "by (seed, epoch, index), which only exist inside the dataset's __getitem__ (or "
            "collate_fn) while a torchrepro.SeededLoader loads it. Iterate the dataset through "
            "SeededLoader, or create your own generator with "
            "numpy.random.default_rng(torchrepro.derive_seed(seed, 'name'))."
        )
    if active.rng is None:
        np = require_numpy("torchrepro.sample_rng()")
        active.rng = np.random.default_rng(active.seed)
    return active.rng


# --------------------------------------------------------------------------------------------
# RNG objects a dataset holds (copied into every worker): re-keyed per sample like the globals.


def _rng_types() -> tuple[type, ...]:
    types: list[type] = [random.Random, torch.Generator]
    np = _numpy()
    if np is not None:
        types += [np.random.Generator, np.random.RandomState]
    return tuple(types)


_Path = tuple[str | int, ...]


def _find_rng_objects(dataset: object, *, max_depth: int = 4, max_items: int = 64) -> tuple[_Path, ...]:
    """Attribute paths (names, list positions) from ``dataset`` to the RNG objects it holds."""
    rng_types = _rng_types()
    found: list[_Path] = []
    seen: set[int] = set()
    skip = (str, bytes, int, float, bool, torch.Tensor, torch.nn.Module, type)

    def visit(obj: object, path: _Path) -> None:
        if id(obj) in seen or isinstance(obj, skip) or len(path) > max_depth:
            return
        seen.add(id(obj))
        if isinstance(obj, rng_types):
            if not isinstance(obj, random.SystemRandom):
                found.append(path)
            return
        if isinstance(obj, (list, tuple)):
            for pos, item in enumerate(obj[:max_items]):
                visit(item, (*path, pos))
            return
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict) and type(obj).__module__ not in ("numpy", "builtins"):
            for name, value in list(attrs.items())[:max_items]:
                visit(value, (*path, name))

    visit(dataset, ())
    return tuple(path for path in found if path)


def _resolve(root: object, path: _Path) -> object:
    obj = root
    for step in path:
        obj = obj[step] if isinstance(step, int) else getattr(obj, step)  # type: ignore[index]
    return obj


def _reseed_object(obj: object, s: int, np: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.manual_seed(s)
    elif isinstance(obj, random.Random):
        obj.seed(s)
    elif np is not None and isinstance(obj, np.random.RandomState):
        obj.seed(s >> 32)
    elif np is not None and isinstance(obj, np.random.Generator):
        bit_generator = obj.bit_generator
        bit_generator.state = type(bit_generator)(s).state


# --------------------------------------------------------------------------------------------
# Order, sharding and the position (the sampler owns it, so rebuilt loaders keep it).


# A sampled key: (epoch, batch index within the epoch, dataset index, _KEY_MARK). A plain tuple
# (pickled to workers at a seventh of a tuple subclass's cost), told apart from a tuple the user
# indexes loader.dataset with by its length and its last element.
_SampleKey = tuple[int, int, int, int]
_KEY_MARK: Final = 0x7E5707D5EED


def _is_key(key: object) -> bool:
    return type(key) is tuple and len(key) == 4 and key[3] == _KEY_MARK


class _SeededSampler(DistributedSampler[_SampleKey]):
    """Yields the sample keys of this rank's shard of one epoch, and holds the position.

    A ``DistributedSampler`` (frameworks that replace a loader's sampler with a distributed one,
    such as Lightning's ``use_distributed_sampler``, keep it: it already shards by rank, padded
    like ``DistributedSampler``). Rank and world size are read from ``torch.distributed`` when a
    pass starts (unless fixed), so a loader built before the process group exists still shards.

    The position is ``(epoch, batches, finished)``: the epoch of the current pass, the batches of
    it the training loop received, and whether the pass ended (its iterator was exhausted).
    ``pending`` means the next pass continues that position instead of starting the next epoch.
    A pass started by ``SeededLoader.__iter__`` is *armed* (the loader already chose where it
    starts, and counts received batches itself); any other pass (a framework that rebuilt a plain
    ``DataLoader`` from this sampler) advances the epoch by itself and counts the batches it
    handed out.
    """

    def __init__(
        self,
        *,
        seed: int,
        length: int,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        shard: tuple[int, int] | None,
    ) -> None:
        # DistributedSampler.__init__ needs a process group or a fixed shard; neither is needed here.
        Sampler.__init__(self)
        self.seed = seed
        self.length = length
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.fixed_shard = shard
        self.epoch = 0
        self.batches = 0
        self.finished = False
        self.pending = True
        self.restored = False  # the position came from load_state_dict; no pass has started since
        self.restart = False  # set_epoch(current epoch) during a pass: the next pass restarts it
        self.armed = False
        self.pass_id: object = object()

    # DistributedSampler's attributes, read now (they follow the process group).
    @property
    def rank(self) -> int:  # type: ignore[override]
        return process_group(self.fixed_shard)[0]

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return process_group(self.fixed_shard)[1]

    def _sizes(self, world_size: int) -> tuple[int, int]:
        """``(num_samples, total_size)`` for ``world_size`` ranks."""
        if self.drop_last and self.length % world_size:
            num_samples = self.length // world_size  # drop the tail so every rank gets as many
        else:
            num_samples = math.ceil(self.length / world_size)  # pad with the first indices
        return num_samples, num_samples * world_size

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        return self._sizes(self.num_replicas)[0]

    @property
    def total_size(self) -> int:  # type: ignore[override]
        return self._sizes(self.num_replicas)[1]

    def num_batches(self) -> int:
        samples = self.num_samples
        return samples // self.batch_size if self.drop_last else math.ceil(samples / self.batch_size)

    def order(self, epoch: int) -> list[int]:
        """The permutation of epoch ``epoch`` (the same on every rank), before sharding."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator()
        generator.manual_seed(derive_seed(self.seed, "order", epoch))
        return torch.randperm(self.length, generator=generator).tolist()

    def shard(self, epoch: int, rank: int | None = None, world_size: int | None = None) -> list[int]:
        """The dataset indices ``rank`` loads in epoch ``epoch``, in order (default: this rank)."""
        if rank is None or world_size is None:
            rank, world_size = process_group(self.fixed_shard)
        indices = self.order(epoch)
        if world_size == 1:
            return indices
        total_size = self._sizes(world_size)[1]
        padding = total_size - len(indices)
        if padding > 0 and indices:
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return indices[rank:total_size:world_size]

    # -- position ---------------------------------------------------------------------------

    def begin_pass(self) -> int:
        """Start a pass: the next epoch unless a position is pending (or the current epoch again
        after ``set_epoch`` during a pass); returns its first batch."""
        if self.restart:
            self.batches, self.finished = 0, False
        elif not self.pending:
            self.epoch, self.batches, self.finished = self.epoch + 1, 0, False
        self.pending = self.restored = self.restart = False
        self.pass_id = object()
        return self.batches

    def end_pass(self) -> None:
        self.finished, self.restart = True, False

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch``, from its first batch. Two exceptions keep a position:
        a position ``load_state_dict`` restored inside epoch ``epoch`` (no pass started since) is
        continued, and a pass of epoch ``epoch`` under way goes on counting (frameworks call
        ``set_epoch`` after their first fetch); a pass started after it restarts the epoch."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}.")
        if epoch == self.epoch and not self.pending and not self.finished:
            self.restart = True  # under way: leave it; the next pass starts this epoch again
            return
        if not (self.restored and epoch == self.epoch):
            self.epoch, self.batches, self.finished = epoch, 0, False
            self.restored = False
        self.pending = True
        self.restart = False
        self.armed = False
        self.pass_id = object()

    def __iter__(self) -> Iterator[_SampleKey]:
        if self.armed:  # SeededLoader.__iter__ began this pass and counts what it delivers
            self.armed = False
            own = True
        else:
            _refuse_resharding()
            self.begin_pass()
            own = False
        return self._keys(self.epoch, self.batches, self.pass_id, own)

    def _keys(self, epoch: int, start: int, pass_id: object, own: bool) -> Iterator[_SampleKey]:
        batch_size = self.batch_size
        indices = self.shard(epoch)
        end = len(indices)
        if self.drop_last:
            end -= end % batch_size
        for pos in range(start * batch_size, end):
            batch = pos // batch_size
            if not own and (pos + 1) % batch_size == 0 and self.pass_id is pass_id:
                # A rebuilt loader's pass: the batches handed out whole (this key completes one,
                # which is loaded as soon as it is taken). Without workers that is what the loop
                # received; with workers it is ahead by what they prefetched.
                self.batches = batch + 1
            yield (epoch, batch, indices[pos], _KEY_MARK)
        if not own and self.pass_id is pass_id:
            self.batches = self.num_batches()
            self.end_pass()

    def __len__(self) -> int:
        return self.num_samples


def _refuse_resharding() -> None:
    """Refuse a pass run by accelerate's ``BatchSamplerShard``: it would shard this rank's shard
    again, and every rank would silently train on a fraction of its data."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        cls = type(owner)
        if cls.__name__ == "BatchSamplerShard" and cls.__module__.startswith("accelerate"):
            raise LoaderConfigError(
                "A SeededLoader was prepared by accelerate with several processes: accelerate splits "
                "its batches across processes again, but a SeededLoader already gives each rank its "
                "own shard (rank and world size from torch.distributed), so every rank would train on "
                "a fraction of its data. Do not pass the SeededLoader to accelerator.prepare(); move "
                "each batch to accelerator.device yourself (with the HF Trainer, use "
                "torchrepro.integrations.transformers.TorchreproTrainer)."
            )
        frame = frame.f_back  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------
# The dataset the DataLoader machinery sees (also inside workers): seeds, loads, collates.


class _Watch:
    """Which global RNGs (``seeding.*_RNG`` bits) a dataset draws from, as one process saw it."""

    __slots__ = ("available", "drawn", "seeded")

    def __init__(self) -> None:
        # torch's RNG is always seeded per sample (2 us): datasets read torch.initial_seed()
        # without drawing (to seed something else), which no check after the batch could see.
        self.available = PYTHON_RNG | NUMPY_RNG if _numpy() is not None else PYTHON_RNG
        self.seeded = self.available  # seeded per sample
        self.drawn = 0  # seen drawn from: seeded per sample for good

    def __getstate__(self) -> tuple[int, int, int]:
        return self.available, self.drawn, self.seeded

    def __setstate__(self, state: tuple[int, int, int]) -> None:
        self.available, self.drawn, self.seeded = state


def _rng_tokens(which: int, np: Any) -> tuple[Any, Any, Any]:
    """Something that changes whenever the global RNGs in ``which`` are drawn from."""
    return (
        _python_mt.token() if which & PYTHON_RNG else None,
        _numpy_mt.token(np) if which & NUMPY_RNG else None,
        torch.default_generator.get_state() if which & TORCH_RNG else None,
    )


def _changed(which: int, before: tuple[Any, Any, Any], np: Any) -> int:
    """The RNGs in ``which`` whose state differs from the tokens ``before``."""
    now = _rng_tokens(which, np)
    changed = 0
    if which & PYTHON_RNG and now[0] != before[0]:
        changed |= PYTHON_RNG
    if which & NUMPY_RNG and now[1] != before[1]:
        changed |= NUMPY_RNG
    if which & TORCH_RNG and not torch.equal(now[2], before[2]):
        changed |= TORCH_RNG
    return changed


class _Collated:
    """A batch already collated by ``_SeededDataset.__getitems__`` (unwrapped by ``_SeededCollate``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _SeededCollate:
    """The loader's ``collate_fn``: the batch was collated, seeded, by ``_SeededDataset``.

    ``collate_fn`` is the user's collate function.
    """

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, _Collated):
            return batch.value
        return self.collate_fn(batch)  # called directly by user code: no key to seed with


class _SeededDataset(Dataset[Any]):
    """The user's dataset as a ``SeededLoader`` loads it: ``loader.dataset``.

    ``__getitems__`` loads a batch of sample keys, each sample seeded, and collates it seeded;
    any other index (an int the user passes) goes to the user's dataset unchanged, and so does
    every attribute it does not define (``loader.dataset.classes``, ``len(loader.dataset)``).
    Because the seeding lives here, a framework that rebuilds a plain ``DataLoader`` from a
    SeededLoader's parts (``dataset``, ``batch_sampler``, ``collate_fn``) keeps its batches.
    Its own attributes start with ``_tr_`` so they never hide one of the user's dataset.

    Global RNG states are captured and put back around each batch in the main process only
    (workers' globals belong to no one). Putting them back once per batch is equivalent to once
    per sample for the training loop: it only observes the state between batches, and every
    sample is reseeded before it runs, so no sample sees what the previous one left.
    """

    def __init__(self, dataset: Any, seed: int, collate_fn: Any, rng_paths: tuple[_Path, ...]) -> None:
        self._tr_source = dataset
        self._tr_seed = seed
        self._tr_collate_fn = collate_fn
        self._tr_rng_paths = rng_paths
        self._tr_batched = callable(getattr(dataset, "__getitems__", None))
        self._tr_derivers: tuple[int, _Deriver, _Deriver, _Deriver | None] | None = None
        self._tr_watch = _Watch()

    def __getattr__(self, name: str) -> Any:
        # Only called for names this object lacks. Private and dunder names are never forwarded
        # (pickle and copy look them up before __init__ state exists).
        if name.startswith(("_tr_", "__")):
            raise AttributeError(name)
        return getattr(self._tr_source, name)

    def __repr__(self) -> str:
        return f"SeededLoader view of {self._tr_source!r}"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tr_derivers"] = None  # hash objects do not pickle (spawn workers); rebuilt on use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self._tr_source)

    def _derivers_for(self, epoch: int) -> tuple[_Deriver, _Deriver, _Deriver | None]:
        cached = self._tr_derivers
        if cached is None or cached[0] != epoch:
            objects = _Deriver(self._tr_seed, ("object", epoch), 4) if self._tr_rng_paths else None
            cached = (
                epoch,
                _Deriver(self._tr_seed, ("sample", epoch), 3),
                _Deriver(self._tr_seed, ("batch", epoch), 3),
                objects,
            )
            self._tr_derivers = cached
        return cached[1], cached[2], cached[3]

    def __getitem__(self, key: Any) -> Any:
        if not _is_key(key):
            return self._tr_source[key]
        return self._load([key]).value

    def __getitems__(self, keys: Sequence[Any]) -> Any:
        if not keys or not _is_key(keys[0]):  # plain indices: the user's dataset, unseeded
            source = self._tr_source
            if self._tr_batched:
                return source.__getitems__(keys)
            return [source[key] for key in keys]
        return self._load(keys)

    def _load_samples(
        self, indices: list[int], seeds: list[int], batch_seed: int, object_seed: _Deriver | None, np: Any
    ) -> list[Any]:
        """Load ``dataset[i]`` for each index, every global RNG it draws from seeded per sample;
        on return every global RNG is in the state seeding it with ``batch_seed`` gives (what
        ``collate_fn`` runs with).

        Seeding the three global RNGs for every sample costs more than many datasets spend
        loading it, and most draw from one or two. So torch's RNG (cheap to seed) and those of
        Python and NumPy this process has seen the dataset draw from are seeded per sample (all
        of them at first). The others are seeded
        once, with the batch seed, and checked after the batch: if the batch drew from one, the
        batch is loaded again with that RNG seeded per sample too (at most once per RNG and
        process). Either way every delivered sample saw exactly the draws it sees when all
        three are seeded per sample: the result never depends on what a process learned.
        An RNG drops out of the per-sample set when the last sample of a batch left it untouched.
        """
        dataset, active, watch = self._tr_source, _active, self._tr_watch
        last = len(indices) - 1
        tokens: Any = None
        while True:
            seeded = watch.seeded & watch.available
            unseeded = watch.available & ~seeded
            learning = seeded & ~watch.drawn
            before = None
            if unseeded:
                sample_seeder(np, unseeded)(batch_seed)
                before = _rng_tokens(unseeded, np)
            seed_globals = sample_seeder(np, seeded | TORCH_RNG)
            samples: list[Any] = []
            append = samples.append
            # The last sample apart: before it, the learning RNGs' states are taken.
            upto = last if learning else last + 1
            for index, s in zip(indices[:upto], seeds[:upto], strict=True):
                seed_globals(s)
                active.seed, active.rng = s, None
                if object_seed is not None:
                    self._reseed_objects(index, object_seed, np)
                append(dataset[index])
            if learning:
                index, s = indices[last], seeds[last]
                seed_globals(s)
                tokens = _rng_tokens(learning, np)
                active.seed, active.rng = s, None
                if object_seed is not None:
                    self._reseed_objects(index, object_seed, np)
                append(dataset[index])
            if before is not None:
                disturbed = _changed(unseeded, before, np)
                if disturbed:  # the batch drew from an RNG that was not seeded per sample: again
                    watch.seeded |= disturbed
                    watch.drawn |= disturbed
                    continue
            if learning:
                used = _changed(learning, tokens, np)
                watch.drawn |= used
                watch.seeded &= ~(learning & ~used)
            seed_globals(batch_seed)
            return samples

    def _reseed_objects(self, index: int, object_seed: _Deriver, np: Any) -> None:
        dataset = self._tr_source
        for path in self._tr_rng_paths:
            _reseed_object(_resolve(dataset, path), object_seed(index, _path_key(path)), np)

    def _load(self, keys: Sequence[_SampleKey]) -> _Collated:
        np = _numpy()
        in_main = get_worker_info() is None
        if in_main:
            saved = (
                _python_mt.save(),
                _numpy_mt.save(np) if np is not None else None,
                torch.get_rng_state(),
            )
        active = _active
        outer = (active.seed, active.rng)
        try:
            epoch, batch_index = keys[0][0], keys[0][1]
            sample_seed, batch_seed, object_seed = self._derivers_for(epoch)
            if self._tr_batched:  # the dataset loads whole batches: seed per batch instead
                seed_globals = sample_seeder(np)
                s = batch_seed.one(batch_index)
                seed_globals(s)
                active.seed, active.rng = s, None
                samples = self._tr_source.__getitems__([key[2] for key in keys])
                seed_globals(s)  # collate_fn runs seeded from the batch key too
                active.seed, active.rng = s, None
            else:
                # Keys first, in one tight loop: interleaved with the samples (which evict the
                # caches) each derivation costs several times more.
                indices = [key[2] for key in keys]
                seeds = sample_seed.many(indices)
                s = batch_seed.one(batch_index)
                samples = self._load_samples(indices, seeds, s, object_seed, np)
                active.seed, active.rng = s, None
            return _Collated(self._tr_collate_fn(samples))
        finally:
            active.seed, active.rng = outer
            if in_main:
                _python_mt.restore(saved[0])
                if np is not None:
                    _numpy_mt.restore(np, saved[1])
                torch.set_rng_state(saved[2])


def _path_key(path: _Path) -> str:
    return ".".join(str(step) for step in path)


# --------------------------------------------------------------------------------------------
# The loader.

_OWNED_KWARGS = {
    "sampler": (
        "SeededLoader draws its own order from (seed, epoch) and must know every position to "
        "save and resume it; a custom sampler would decide the order instead. Pass shuffle=False "
        "for a fixed order, rank=/world_size= for distributed shards, or wrap the dataset in "
        "torch.utils.data.Subset to load a subset."
    ),
    "batch_sampler": (
        "SeededLoader builds its batches from batch_size, drop_last and its own seeded order, so "
        "that their position can be saved and resumed; a custom batch_sampler would decide them "
        "instead. Pass batch_size= and drop_last=, or use a plain torch DataLoader for custom "
        "batching."
    ),
    "generator": (
        "SeededLoader owns its generators: the order comes from derive_seed(seed, 'order', epoch) "
        "and never from a generator you pass; pass seed= to choose the stream."
    ),
}


# The worker-seed generators SeededLoaders create: handed back by a framework that rebuilds a
# SeededLoader from its attributes, they are dropped instead of refused.
_OWN_GENERATORS: MutableSet[torch.Generator] = generator_set()


def _drop_own_parts(kwargs: dict[str, Any]) -> None:
    """Drop, from the keyword arguments of a SeededLoader being built, the parts another
    SeededLoader made (a framework rebuilding one from its attributes passes them back), and
    unwrap its collate function to the user's."""
    sampler = kwargs.get("sampler")
    if isinstance(sampler, _SeededSampler):
        del kwargs["sampler"]
    batch_sampler = kwargs.get("batch_sampler")
    if batch_sampler is not None and isinstance(getattr(batch_sampler, "sampler", None), _SeededSampler):
        del kwargs["batch_sampler"]
    if kwargs.get("generator") in _OWN_GENERATORS:
        del kwargs["generator"]
    collate_fn = kwargs.get("collate_fn")
    if isinstance(collate_fn, _SeededCollate):
        kwargs["collate_fn"] = collate_fn.collate_fn


def _fixed_shard(rank: int | None, world_size: int | None) -> tuple[int, int] | None:
    """The shard given as ``rank``/``world_size``, validated; ``None`` to follow torch.distributed."""
    if rank is None and world_size is None:
        return None
    if rank is None or world_size is None:
        raise LoaderConfigError(
            f"SeededLoader got rank={rank!r} and world_size={world_size!r}; pass both, or neither "
            "to read them from torch.distributed when each pass starts."
        )
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"SeededLoader needs world_size >= 1 and 0 <= rank < world_size, got rank={rank}, "
            f"world_size={world_size}."
        )
    return rank, world_size


class _SeededLoaderIter:
    """One pass of a ``SeededLoader``: counts the batches the training loop receives.

    The pass starts at the first ``next()``, not at ``iter()``: frameworks create the iterator
    and then call ``set_epoch``, which must still decide the pass's epoch (with workers, the
    DataLoader hands out sample keys as soon as its iterator exists).
    """

    def __init__(self, loader: SeededLoader) -> None:
        self._loader = loader
        self._sampler = loader._seeded_sampler
        self._inner: Iterator[Any] | None = None
        self._pass_id: object = None
        self._received = 0

    def __iter__(self) -> _SeededLoaderIter:
        return self

    def _begin(self) -> Iterator[Any]:
        loader, sampler = self._loader, self._sampler
        self._received = sampler.begin_pass()
        self._pass_id = sampler.pass_id
        sampler.armed = True
        assert loader.generator is not None
        loader.generator.manual_seed(derive_seed(loader.seed, "workers", sampler.epoch))
        self._inner = inner = DataLoader.__iter__(loader)
        return inner

    def __next__(self) -> Any:
        inner = self._inner if self._inner is not None else self._begin()
        sampler = self._sampler
        try:
            batch = next(inner)
        except StopIteration:
            if sampler.pass_id is self._pass_id:
                sampler.end_pass()
            raise
        self._received += 1
        if sampler.pass_id is self._pass_id:  # unless a later pass, set_epoch or load_state_dict
            sampler.batches = self._received
        return batch

    def __len__(self) -> int:
        if self._inner is None:
            sampler = self._sampler
            start = 0 if not sampler.pending or sampler.restart else sampler.batches
            return max(len(self._loader) - start, 0)
        return max(len(self._loader) - self._received, 0)


class SeededLoader(DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` whose batches depend only on ``(seed, epoch)``.

    - **Order**: epoch ``e`` is a permutation drawn from the loader's own generator seeded with
      ``derive_seed(seed, "order", e)`` (never from the global RNG). With ``rank``/``world_size``
      (read from ``torch.distributed`` when it is initialised and neither is given) every rank
      takes its shard of the same permutation, padded with the first indices like
      ``DistributedSampler``, or with the uneven tail dropped when ``drop_last=True``.
    - **Epochs** advance by themselves: each new ``iter()`` is the next epoch; ``set_epoch(e)``
      makes the next pass epoch ``e`` (keeping a restored position inside epoch ``e``).
    - **Frameworks**: ``loader.dataset`` is a view of your dataset (``loader.source_dataset``)
      that seeds each sample and forwards your dataset's attributes; the sampler is a
      ``DistributedSampler`` (Lightning keeps it) that reads rank and world size when each pass
      starts. A plain ``DataLoader`` rebuilt from ``dataset``, ``batch_sampler`` and
      ``collate_fn`` (``accelerator.prepare``) yields the same batches and advances the epoch
      on each pass.
    - **Randomness**: before ``dataset[i]`` in epoch ``e``, Python ``random``, NumPy's global RNG
      and torch's CPU RNG are seeded from ``derive_seed(seed, "sample", e, i)``, and so are the
      RNG objects the dataset holds (``random.Random``, ``torch.Generator``,
      ``numpy.random.Generator``/``RandomState`` attributes, which every worker would otherwise
      copy and repeat); :func:`sample_rng` gives a NumPy generator keyed the same way.
      ``collate_fn`` runs seeded from ``derive_seed(seed, "batch", e, batch_index)``. A dataset
      with ``__getitems__`` loads whole batches, seeded per batch. In the main process the global
      RNG states are put back after each batch: loading never moves the model's RNG stream.
      CUDA generators are not seeded per sample: draw augmentation randomness on the CPU.
    - **Guarantee**: the batches of every epoch are bitwise identical for any ``num_workers``,
      ``persistent_workers``, ``prefetch_factor``, start method and ``pin_memory``.
    - **Resume**: :meth:`state_dict` (JSON) records the position as the batches the training loop
      received; after :meth:`load_state_dict` the next pass continues right after them, skipping
      by index (no skipped sample is loaded). A pass that had ended resumes at the next epoch; one
      saved inside the loop after its last batch resumes into that epoch's empty rest.

    ``seed=None`` takes the seed given to ``torchrepro.seed_everything``. Other keyword arguments
    go to ``DataLoader``, except ``sampler``, ``batch_sampler`` and ``generator`` (the loader owns
    its order) and ``in_order=False`` (batch order would depend on worker timing). Only map-style
    datasets (``__getitem__`` and ``__len__``) are supported.

    >>> loader = SeededLoader(list(range(10)), batch_size=4, seed=0)
    >>> [batch.tolist() for batch in loader]
    [[4, 9, 6, 8], [1, 3, 0, 5], [2, 7]]
    >>> loader.state_dict()["epoch"], loader.state_dict()["batches_consumed"]
    (0, 3)
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        seed: int | None = None,
        shuffle: bool = True,
        num_workers: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        if isinstance(dataset, _SeededDataset):  # rebuilt from another SeededLoader's parts
            seed = dataset._tr_seed if seed is None else seed
            dataset = dataset._tr_source
        _drop_own_parts(dataloader_kwargs)
        if isinstance(dataset, IterableDataset):
            raise UnsupportedDatasetError(
                f"SeededLoader supports map-style datasets (with __getitem__ and __len__), got the "
                f"IterableDataset {type(dataset).__name__}: its order and randomness live inside "
                "its __iter__, where they cannot be keyed by index, skipped by index on resume, or "
                "made independent of num_workers. Use a map-style Dataset, or a plain DataLoader."
            )
        if not callable(getattr(dataset, "__getitem__", None)) or not callable(
            getattr(dataset, "__len__", None)
        ):
            raise UnsupportedDatasetError(
                f"SeededLoader needs a map-style dataset with __getitem__ and __len__, got "
                f"{type(dataset).__name__}."
            )
        if isinstance(dataloader_kwargs.get("sampler"), DistributedSampler):
            raise LoaderConfigError(
                "SeededLoader does not accept sampler=DistributedSampler(...): it gives each rank its "
                "own shard itself (rank and world size from torch.distributed when each pass starts, "
                "or rank=/world_size=), and its own sampler is a DistributedSampler, which Lightning's "
                "use_distributed_sampler=True keeps. If a framework injected this sampler, turn that "
                "off (Lightning: Trainer(use_distributed_sampler=False)) or pass the SeededLoader as "
                "it is."
            )
        for name, why in _OWNED_KWARGS.items():
            if dataloader_kwargs.get(name) is not None:
                raise LoaderConfigError(f"SeededLoader does not accept {name}=. {why}")
            dataloader_kwargs.pop(name, None)
        if dataloader_kwargs.get("in_order", True) is not True:
            raise LoaderConfigError(
                "SeededLoader needs in_order=True: with in_order=False batches arrive in the order "
                "workers finish them, so the batch order would depend on timing and num_workers."
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"SeededLoader needs batch_size to be a positive int, got {batch_size!r}; "
                "(batch_size=None, no batching, is not supported: use batch_size=1)."
            )
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}.")
        if seed is None:
            seed = current_seed()
            if seed is None:
                raise LoaderConfigError(
                    "SeededLoader has no seed: pass seed=<int>, or call "
                    "torchrepro.seed_everything(<int>) before creating the loader."
                )
        seed = validate_seed(seed)
        shard = _fixed_shard(rank, world_size)

        collate_fn = dataloader_kwargs.pop("collate_fn", None) or default_collate
        sampler = _SeededSampler(
            seed=seed,
            length=len(dataset),
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            shard=shard,
        )
        # Worker base seeds (DataLoader draws one per iterator) come from this generator, reseeded
        # per pass: iter() never draws from the global torch RNG.
        generator = torch.Generator()
        generator.manual_seed(derive_seed(seed, "workers", 0))
        _OWN_GENERATORS.add(generator)
        super().__init__(
            _SeededDataset(dataset, seed, collate_fn, _find_rng_objects(dataset)),
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=_SeededCollate(collate_fn),
            drop_last=drop_last,
            generator=generator,
            **dataloader_kwargs,
        )
        self._seed = seed
        self._shuffle = shuffle
        self._seeded_sampler = sampler

    # -- position ---------------------------------------------------------------------------

    @property
    def seed(self) -> int:
        """The seed every order and sample key is derived from."""
        return self._seed

    @property
    def source_dataset(self) -> Any:
        """The dataset you passed (``loader.dataset`` is a seeding view of it that forwards its
        attributes and plain indices)."""
        view = self.dataset
        assert isinstance(view, _SeededDataset)
        return view._tr_source

    @property
    def epoch(self) -> int:
        """The epoch of the current pass (or of the next one after ``set_epoch``/``load_state_dict``)."""
        return self._seeded_sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch``, from its first batch.

        After ``load_state_dict`` restored a position inside epoch ``epoch`` (and before a pass
        started), the position is kept: ``for epoch in range(start, E): loader.set_epoch(epoch)``
        after a restore continues right after the last received batch. Otherwise (another epoch,
        a pass left early, a pass that ended) the epoch starts from its first batch, as with
        ``DistributedSampler``.
        """
        self._seeded_sampler.set_epoch(epoch)

    def __iter__(self) -> _SeededLoaderIter:  # type: ignore[override]
        return _SeededLoaderIter(self)

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position as a JSON-serialisable dict: seed, epoch, batches received, whether that
        pass ended (``finished``), sizes, version.

        ``batches_consumed`` counts the batches of ``epoch`` the training loop received (batches
        workers prefetched but did not deliver are not counted).
        """
        sampler = self._seeded_sampler
        rank, world_size = process_group(sampler.fixed_shard)
        return {
            "version": STATE_VERSION,
            "seed": self._seed,
            "epoch": sampler.epoch,
            "batches_consumed": sampler.batches,
            "finished": sampler.finished,
            "num_batches": len(self),
            "dataset_length": sampler.length,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "shuffle": self._shuffle,
            "rank": rank,
            "world_size": world_size,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict``: the next pass starts right after its last received batch.

        A finished epoch continues at the next epoch. The rank may differ (every rank is at the
        same position); a different seed, dataset length, batch size, world size, ``drop_last``
        or ``shuffle`` raises ``DataLoaderStateError`` naming the mismatch.
        """
        if not isinstance(state_dict, Mapping):
            raise DataLoaderStateError(
                f"SeededLoader.load_state_dict expects the dict state_dict() returned, got "
                f"{type(state_dict).__name__}."
            )
        version = state_dict.get("version")
        if version != STATE_VERSION:
            raise DataLoaderStateError(
                f"Loader state has version {version!r}, this torchrepro reads version {STATE_VERSION}; "
                "save it again with this version, or load it with the torchrepro that wrote it."
            )
        ints = ("seed", "epoch", "batches_consumed", "dataset_length", "batch_size", "world_size")
        missing = [k for k in (*ints, "drop_last", "shuffle") if k not in state_dict]
        if missing:
            raise DataLoaderStateError(
                f"Loader state is missing {', '.join(missing)}; pass the dict SeededLoader.state_dict() "
                "returned."
            )
        for key in ints:
            value = state_dict[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DataLoaderStateError(f"Loader state has {key}={value!r}; expected an int >= 0.")
        expected = self.state_dict()
        mismatches = [
            f"{key}: state has {state_dict[key]!r}, this loader has {expected[key]!r}"
            for key in ("seed", "dataset_length", "batch_size", "world_size", "drop_last", "shuffle")
            if state_dict[key] != expected[key]
        ]
        if mismatches:
            raise DataLoaderStateError(
                "Loader state does not fit this SeededLoader ("
                + "; ".join(mismatches)
                + "). Create the loader with the same dataset, seed, batch_size, drop_last, shuffle "
                "and world size as the run that saved the state."
            )
        batches, num_batches = state_dict["batches_consumed"], len(self)
        if batches > num_batches:
            raise DataLoaderStateError(
                f"Loader state has batches_consumed={batches}, but an epoch of this loader has only "
                f"{num_batches} batches."
            )
        finished = state_dict.get("finished", batches == num_batches)  # absent before 0.1.1
        if not isinstance(finished, bool):
            raise DataLoaderStateError(f"Loader state has finished={finished!r}; expected a bool.")
        epoch = state_dict["epoch"]
        if finished:  # the saved pass had ended: continue at the next epoch
            epoch, batches = epoch + 1, 0
        # Saved inside a pass (even after its last batch): the rest of that epoch comes first, so
        # the code after the loop's inner `for` runs once, as it did in the saved run.
        sampler = self._seeded_sampler
        sampler.epoch, sampler.batches, sampler.finished = epoch, batches, False
        sampler.pending, sampler.restored, sampler.armed, sampler.pass_id = True, True, False, object()
        sampler.restart = False
