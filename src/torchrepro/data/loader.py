"""``SeededLoader``: a ``DataLoader`` whose batches depend only on (seed, epoch), and its passes.

Invariants:
- The loader owns its order (``sampler``, ``batch_sampler`` and ``generator`` are refused, except
  the parts another ``SeededLoader`` made, handed back by a framework rebuilding one) and keeps
  ``in_order=True``; worker base seeds come from its own generator, reseeded per pass from
  ``derive_seed(seed, "workers", epoch)``: ``iter()`` never draws from the global torch RNG.
- The position is the number of batches the training loop *received* in the current epoch (not
  what workers prefetched) and whether that pass ended; resuming skips by index, without loading
  the skipped samples. A state saved inside a pass, even after its last batch, resumes into the
  rest of that epoch (possibly empty), so code after the loop's inner ``for`` runs once.
- The loader adds no state of its own to its parts: the sampler (``sampler``) holds the position,
  the view (``view``) does the seeding; ``state_dict()`` is JSON and names its ``STATE_VERSION``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableSet
from typing import Any, Final

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate
from torch.utils.data.distributed import DistributedSampler

from torchrepro._compat import generator_set
from torchrepro._runtime import process_group
from torchrepro.data.micro import MicroBatchSampler, check_global_batch_size
from torchrepro.data.sampler import SeededSampler
from torchrepro.data.view import SeededCollate, SeededDataset
from torchrepro.data.watch import find_rng_objects
from torchrepro.errors import DataLoaderStateError, LoaderConfigError, UnsupportedDatasetError
from torchrepro.seeding import current_seed, derive_seed, validate_seed

__all__ = ["STATE_VERSION", "LoaderConfigError", "SeededLoader", "UnsupportedDatasetError"]

STATE_VERSION: Final = 1
"""Version of the dict ``SeededLoader.state_dict()`` returns."""


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
OWN_GENERATORS: MutableSet[torch.Generator] = generator_set()


def _drop_own_parts(kwargs: dict[str, Any]) -> None:
    """Drop, from the keyword arguments of a SeededLoader being built, the parts another
    SeededLoader made (a framework rebuilding one from its attributes passes them back), and
    unwrap its collate function to the user's."""
    sampler = kwargs.get("sampler")
    if isinstance(sampler, SeededSampler):
        del kwargs["sampler"]
    batch_sampler = kwargs.get("batch_sampler")
    if batch_sampler is not None and isinstance(getattr(batch_sampler, "sampler", None), SeededSampler):
        del kwargs["batch_sampler"]
    if kwargs.get("generator") in OWN_GENERATORS:
        del kwargs["generator"]
    collate_fn = kwargs.get("collate_fn")
    if isinstance(collate_fn, SeededCollate):
        kwargs["collate_fn"] = collate_fn.collate_fn


def fixed_shard(rank: int | None, world_size: int | None) -> tuple[int, int] | None:
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


def _check_global_batch(global_batch_size: Any, batch_size: int, length: int, drop_last: bool) -> None:
    """Refuse a ``global_batch_size`` that is not a whole number of micro-batches, or an epoch
    whose last global batch would be incomplete without ``drop_last``."""
    check_global_batch_size(global_batch_size, batch_size)
    rest = length % global_batch_size
    if rest and not drop_last:
        raise LoaderConfigError(
            f"The dataset's {length} samples are not a whole number of global batches of "
            f"{global_batch_size}: the last would hold {rest} samples, and its mean would have another "
            "denominator and shape on each world size. Pass drop_last=True to drop those samples "
            "each epoch (which samples are dropped changes with the epoch's order), or choose a "
            f"global_batch_size that divides {length}."
        )
    if length < global_batch_size:
        raise LoaderConfigError(
            f"The dataset has {length} samples, fewer than one global batch of {global_batch_size}."
        )


def checked_arguments(
    batch_size: Any, shuffle: Any, drop_last: Any, seed: Any, kwargs: dict[str, Any]
) -> int:
    """Check what every SeededLoader takes (the ``DataLoader`` arguments it owns are refused and
    dropped from ``kwargs``); the seed to use."""
    if isinstance(kwargs.get("sampler"), DistributedSampler):
        raise LoaderConfigError(
            "SeededLoader does not accept sampler=DistributedSampler(...): it gives each rank its "
            "own shard itself (rank and world size from torch.distributed when each pass starts, "
            "or rank=/world_size=), and its own sampler is a DistributedSampler, which Lightning's "
            "use_distributed_sampler=True keeps. If a framework injected this sampler, turn that "
            "off (Lightning: Trainer(use_distributed_sampler=False)) or pass the SeededLoader as "
            "it is."
        )
    for name, why in _OWNED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise LoaderConfigError(f"SeededLoader does not accept {name}=. {why}")
        kwargs.pop(name, None)
    if kwargs.get("in_order", True) is not True:
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
    return validate_seed(seed)


class SeededLoaderIter:
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

    def __iter__(self) -> SeededLoaderIter:
        return self

    def _begin(self) -> Iterator[Any]:
        loader, sampler = self._loader, self._sampler
        self._received = sampler.begin_pass()
        self._pass_id = sampler.pass_id
        sampler.armed = True
        assert loader.generator is not None
        loader.generator.manual_seed(derive_seed(loader.seed, "workers", sampler.epoch))
        self._inner = inner = self._batches()
        return inner

    def _batches(self) -> Iterator[Any]:
        """The batches of the pass just begun, from its first one not yet received."""
        return DataLoader.__iter__(self._loader)

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
    # ``SeededLoader(ShardedDataset(...), ...)`` is a ``StreamingLoader`` (``data.streaming``).
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
    - **Global batches** (``global_batch_size=G``): ``batch_size`` is the micro-batch size ``m``
      and each global batch of the epoch's order is ``V = G // m`` micro-batches; rank ``r`` of
      ``W`` yields the contiguous block ``[r*V/W, (r+1)*V/W)`` of every global batch, in order
      (``accumulation_steps`` micro-batches). A micro-batch holds the same samples, loaded the same
      way, on every world size; with :class:`torchrepro.InvariantDataParallel` the training
      result is the same bits for any ``W`` dividing ``V``, and a state saved at a global batch
      boundary resumes on another world size.
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

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> SeededLoader:
        # A dataset names the loader class that loads it (``ShardedDataset._tr_loader`` is
        # ``StreamingLoader``, set when ``data.streaming`` is imported, as ``torchrepro.ShardedDataset``
        # does): this module imports neither.
        loader_class = getattr(type(dataset), "_tr_loader", None)
        if cls is SeededLoader and isinstance(loader_class, type) and issubclass(loader_class, SeededLoader):
            return super().__new__(loader_class)
        return super().__new__(cls)

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
        global_batch_size: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        if isinstance(dataset, SeededDataset):  # rebuilt from another SeededLoader's parts
            seed = dataset._tr_seed if seed is None else seed
            dataset = dataset._tr_source
        _drop_own_parts(dataloader_kwargs)
        if isinstance(dataset, IterableDataset):
            raise UnsupportedDatasetError(
                f"SeededLoader got the IterableDataset {type(dataset).__name__}: its order and "
                "randomness live inside its __iter__, where they cannot be keyed by sample, resumed "
                "by position, or made independent of num_workers and the world size. Stream it as "
                "torchrepro.ShardedDataset(shards, read_shard) (read_shard(shard) yields one shard's "
                "samples; Hugging Face streaming: ShardedDataset.from_hf(ds)), or use a map-style "
                "Dataset."
            )
        if not callable(getattr(dataset, "__getitem__", None)) or not callable(
            getattr(dataset, "__len__", None)
        ):
            raise UnsupportedDatasetError(
                f"SeededLoader needs a map-style dataset with __getitem__ and __len__, got "
                f"{type(dataset).__name__}."
            )
        seed = checked_arguments(batch_size, shuffle, drop_last, seed, dataloader_kwargs)
        if "shuffle_buffer" in dataloader_kwargs:
            raise LoaderConfigError(
                "shuffle_buffer= is for streamed data (a torchrepro.ShardedDataset); a map-style "
                "dataset is shuffled whole each epoch (shuffle=True)."
            )
        shard = fixed_shard(rank, world_size)

        collate_fn = dataloader_kwargs.pop("collate_fn", None) or default_collate
        parts: dict[str, Any] = {
            "seed": seed,
            "length": len(dataset),
            "batch_size": batch_size,
            "shuffle": shuffle,
            "drop_last": drop_last,
            "shard": shard,
        }
        if global_batch_size is None:
            sampler: SeededSampler = SeededSampler(**parts)
        else:
            _check_global_batch(global_batch_size, batch_size, len(dataset), drop_last)
            sampler = MicroBatchSampler(global_batch_size=global_batch_size, **parts)
        # Worker base seeds (DataLoader draws one per iterator) come from this generator, reseeded
        # per pass: iter() never draws from the global torch RNG.
        generator = torch.Generator()
        generator.manual_seed(derive_seed(seed, "workers", 0))
        OWN_GENERATORS.add(generator)
        super().__init__(
            SeededDataset(dataset, seed, collate_fn, find_rng_objects(dataset)),
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=SeededCollate(collate_fn),
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
    def global_batch_size(self) -> int | None:
        """The samples of a global batch (``None``: the loader has no global batches)."""
        sampler = self._seeded_sampler
        return sampler.global_batch_size if isinstance(sampler, MicroBatchSampler) else None

    @property
    def micro_batches(self) -> int:
        """``V``: the micro-batches of a global batch (``global_batch_size // batch_size``); 1
        without ``global_batch_size``."""
        sampler = self._seeded_sampler
        return sampler.micro_batches if isinstance(sampler, MicroBatchSampler) else 1

    @property
    def accumulation_steps(self) -> int:
        """The micro-batches this rank computes of each global batch: ``V // world_size`` (read
        from ``torch.distributed`` now, unless ``rank``/``world_size`` were given); 1 without
        ``global_batch_size``. Raises ``LoaderConfigError`` naming the world sizes that work when
        the world size does not divide ``V``."""
        sampler = self._seeded_sampler
        return sampler.accumulation_steps() if isinstance(sampler, MicroBatchSampler) else 1

    @property
    def source_dataset(self) -> Any:
        """The dataset you passed (``loader.dataset`` is a seeding view of it that forwards its
        attributes and plain indices)."""
        view = self.dataset
        assert isinstance(view, SeededDataset)
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

    def __iter__(self) -> SeededLoaderIter:  # type: ignore[override]
        return SeededLoaderIter(self)

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
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict``: the next pass starts right after its last received batch.

        A finished epoch continues at the next epoch. The rank may differ (every rank is at the
        same position); a different seed, dataset length, batch size, world size, ``drop_last``,
        ``shuffle`` or ``global_batch_size`` raises ``DataLoaderStateError`` naming the mismatch.
        With ``global_batch_size`` the world size may differ when the state was saved at a global
        batch boundary: the position is then a number of whole global batches.
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
        invariant = expected["global_batch_size"] is not None
        compared: tuple[str, ...] = ("seed", "dataset_length", "batch_size", "drop_last", "shuffle")
        compared += ("global_batch_size",)
        if not invariant:
            compared += ("world_size",)
        mismatches = [
            f"{key}: state has {state_dict.get(key)!r}, this loader has {expected[key]!r}"
            for key in compared
            if state_dict.get(key) != expected[key]
        ]
        if mismatches:
            raise DataLoaderStateError(
                "Loader state does not fit this SeededLoader ("
                + "; ".join(mismatches)
                + "). Create the loader with the same dataset, seed, batch_size, drop_last, shuffle"
                + (", global_batch_size" if invariant else ", global_batch_size and world size")
                + " as the run that saved the state."
            )
        batches, num_batches = state_dict["batches_consumed"], len(self)
        if invariant and state_dict["world_size"] != expected["world_size"]:
            batches = self._convert_position(batches, state_dict["world_size"], expected["world_size"])
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
        self._seeded_sampler.restore(epoch, batches)

    def _convert_position(self, batches: int, saved_world: int, world: int) -> int:
        """The micro-batches a rank of ``world`` has received at the position where a rank of
        ``saved_world`` had received ``batches``: the same number of whole global batches."""
        sampler = self._seeded_sampler
        assert isinstance(sampler, MicroBatchSampler)
        if saved_world < 1:
            raise DataLoaderStateError(f"Loader state has world_size={saved_world}; expected an int >= 1.")
        try:
            whole, into = sampler.global_position(batches, saved_world)
        except LoaderConfigError as e:
            raise DataLoaderStateError(f"Loader state cannot be placed: {e}") from None
        if into:
            raise DataLoaderStateError(
                f"Loader state was saved {into} micro-batches into global batch {whole} of its epoch, by "
                f"a run of world size {saved_world}; on world size {world} each rank computes other "
                "micro-batches of that global batch, so only a state saved at a global batch boundary "
                "(after the optimizer step) resumes on another world size. Resume on "
                f"{saved_world} processes, or save after the optimizer step."
            )
        return whole * sampler.accumulation_steps(world)
