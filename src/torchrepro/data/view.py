"""The seeding view of the user's dataset (``loader.dataset``), its collate wrapper, ``sample_rng``.

Invariants:
- Sample ``i`` of epoch ``e`` is loaded with Python ``random``, NumPy's global RNG and torch's
  CPU RNG seeded from ``derive_seed(seed, "sample", e, i)`` (and ``sample_rng()`` keyed the same),
  and the RNG objects the dataset holds reseeded (``watch``); ``collate_fn`` runs seeded from
  ``derive_seed(seed, "batch", e, b)``. Which process or worker loads a sample, and when,
  therefore changes nothing: batches are bitwise identical for any ``num_workers``,
  ``persistent_workers``, ``prefetch_factor``, start method or ``pin_memory``.
- A global RNG ``watch`` has not seen the dataset draw from is seeded once per batch and checked
  after it; if the batch drew from it, the batch is loaded again seeded per sample: every
  delivered sample sees exactly the draws it sees when all three are seeded per sample.
- In the main process (``num_workers=0``) the global RNG states are put back after every batch
  (through ``rawrng``), so loading never moves the training loop's RNG stream.
- The view is self-sufficient: it holds the seed, the user's collate function and where the
  dataset's RNG objects are, forwards the user's attributes and plain indices, and pickles to
  workers; ``SeededCollate`` unwraps what it collated. A framework that rebuilds a plain
  ``DataLoader`` from a loader's parts gets the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from torchrepro._compat import numpy_or_none, require_numpy
from torchrepro.data.keys import SampleKey, is_key
from torchrepro.data.rawrng import _python_mt, numpy_mt, raw_access, set_raw_access
from torchrepro.data.watch import Path, Watch, _changed, reseed_objects, rng_tokens
from torchrepro.errors import LoaderConfigError
from torchrepro.seeding import TORCH_RNG, Deriver, sample_seeder

__all__ = ["sample_rng"]

# --------------------------------------------------------------------------------------------
# The generator sample_rng() returns.


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
# The dataset the DataLoader machinery sees (also inside workers): seeds, loads, collates.


class _Collated:
    """A batch already collated by ``SeededDataset.__getitems__`` (unwrapped by ``SeededCollate``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class SeededCollate:
    """The loader's ``collate_fn``: the batch was collated, seeded, by ``SeededDataset``.

    ``collate_fn`` is the user's collate function.
    """

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, _Collated):
            return batch.value
        return self.collate_fn(batch)  # called directly by user code: no key to seed with


class SeededDataset(Dataset[Any]):
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

    def __init__(self, dataset: Any, seed: int, collate_fn: Any, rng_paths: tuple[Path, ...]) -> None:
        self._tr_source = dataset
        self._tr_seed = seed
        self._tr_collate_fn = collate_fn
        self._tr_rng_paths = rng_paths
        self._tr_batched = callable(getattr(dataset, "__getitems__", None))
        self._tr_derivers: tuple[int, Deriver, Deriver, Deriver | None] | None = None
        self._tr_watch = Watch()

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
        state["_tr_raw_access"] = raw_access()  # a spawned worker follows the parent's switch
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if not state.pop("_tr_raw_access", True):
            set_raw_access(False)
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self._tr_source)

    def _derivers_for(self, epoch: int) -> tuple[Deriver, Deriver, Deriver | None]:
        cached = self._tr_derivers
        if cached is None or cached[0] != epoch:
            objects = Deriver(self._tr_seed, ("object", epoch), 4) if self._tr_rng_paths else None
            cached = (
                epoch,
                Deriver(self._tr_seed, ("sample", epoch), 3),
                Deriver(self._tr_seed, ("batch", epoch), 3),
                objects,
            )
            self._tr_derivers = cached
        return cached[1], cached[2], cached[3]

    def __getitem__(self, key: Any) -> Any:
        if not is_key(key):
            return self._tr_source[key]
        return self._load([key]).value

    def __getitems__(self, keys: Sequence[Any]) -> Any:
        if not keys or not is_key(keys[0]):  # plain indices: the user's dataset, unseeded
            source = self._tr_source
            if self._tr_batched:
                return source.__getitems__(keys)
            return [source[key] for key in keys]
        return self._load(keys)

    def _load_samples(
        self, indices: list[int], seeds: list[int], batch_seed: int, object_seed: Deriver | None, np: Any
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
                before = rng_tokens(unseeded, np)
            seed_globals = sample_seeder(np, seeded | TORCH_RNG)
            samples: list[Any] = []
            append = samples.append
            # The last sample apart: before it, the learning RNGs' states are taken.
            upto = last if learning else last + 1
            for index, s in zip(indices[:upto], seeds[:upto], strict=True):
                seed_globals(s)
                active.seed, active.rng = s, None
                if object_seed is not None:
                    reseed_objects(dataset, self._tr_rng_paths, index, object_seed, np)
                append(dataset[index])
            if learning:
                index, s = indices[last], seeds[last]
                seed_globals(s)
                tokens = rng_tokens(learning, np)
                active.seed, active.rng = s, None
                if object_seed is not None:
                    reseed_objects(dataset, self._tr_rng_paths, index, object_seed, np)
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

    def _load(self, keys: Sequence[SampleKey]) -> _Collated:
        np = numpy_or_none()
        in_main = get_worker_info() is None
        if in_main:
            saved = (
                _python_mt.save(),
                numpy_mt.save(np) if np is not None else None,
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
                    numpy_mt.restore(np, saved[1])
                torch.set_rng_state(saved[2])
