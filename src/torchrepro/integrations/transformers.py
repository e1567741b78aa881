"""The Hugging Face ``Trainer`` with a ``SeededLoader`` as its train loader.

Invariants:
- The train loader is a ``torchrepro.SeededLoader`` over the Trainer's train dataset and collator,
  built from ``TrainingArguments`` (batch size, workers, ``drop_last``, pin memory...) and seeded
  with ``args.data_seed``, or ``args.seed`` when it is ``None`` (the Trainer's own rule for data
  order). Unlike the stock loader it is not passed to ``accelerator.prepare``: on several
  processes accelerate would shard its batches again (the loader shards itself, following
  ``torch.distributed``); the Trainer moves each batch to its device itself.
- Resume is the Trainer's own: its step counters, ``skip_first_batches`` (which skips by batch
  index through the loader's sampler: no skipped sample is loaded) and its ``rng_state*.pth``,
  restored after the first batches of the resumed epoch are fetched. The epoch of every pass is
  set from the Trainer's step counter, so it does not depend on how the loader was rebuilt.
- A streamed train dataset (a ``torchrepro.ShardedDataset``, or a ``datasets.IterableDataset``,
  streamed through ``ShardedDataset.from_hf``) is loaded by a streamed ``SeededLoader``
  (``_TrainerStream``), which needs ``max_steps``: the Trainer cannot count a stream's epochs.
  Its resume is the loader's own, never the Trainer's fast-forward (which iterates the stream
  from its start, ``global_step x gradient_accumulation_steps`` batches, whatever the epoch):
  each checkpoint's ``trainer_state.json`` holds the loader's position (the stateful callback
  ``TorchreproStreamPosition``), restored when training starts, and the Trainer runs with
  ``ignore_data_skip=True`` (on a copy of its arguments). The Trainer numbers its passes from 0
  in every ``train()`` call; its ``set_epoch(k)`` is the restored epoch plus ``k``.
- The mixin overrides ``__init__`` and ``get_train_dataloader`` only, with cooperative ``super()``
  calls, so it composes with ``Trainer`` subclasses placed after it.
- It does not change the determinism switches: they are process-wide and, on CUDA, must be set
  before the process starts CUDA (``torchrepro.set_determinism`` or ``torchrepro run``), and the
  Trainer has placed the model on its device before training starts. When training starts with
  switches short of strict mode (and ``TrainingArguments(full_determinism=True)`` not given), one
  ``ReproWarning`` per process names them and the fix.
- Importing this module imports ``transformers`` and ``accelerate``; ``import torchrepro`` never does.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

try:
    importlib.import_module("accelerate")
    import transformers
except ModuleNotFoundError as error:
    if error.name not in ("transformers", "accelerate"):
        raise
    raise ModuleNotFoundError(
        f"torchrepro.integrations.transformers needs the Hugging Face `transformers` and `accelerate` "
        f"packages, and `{error.name}` is not installed. Install them with "
        "`pip install torchrepro[transformers]`.",
        name=error.name,
    ) from None

from torchrepro.data import SeededLoader
from torchrepro.data.sharded import ShardedDataset
from torchrepro.data.streaming import StreamingLoader
from torchrepro.errors import LoaderConfigError, ReproWarning, warn_once

__all__ = ["TorchreproTrainer", "TorchreproTrainerMixin"]

if TYPE_CHECKING:
    _TrainerBase = transformers.Trainer
else:
    _TrainerBase = object

_SAMPLING = {"random": True, "sequential": False}  # train_sampling_strategy -> shuffle


class _SeededEpochs(transformers.TrainerCallback):
    """Sets the epoch of the seeded train loader before each epoch, from the Trainer's step counter.

    The Trainer computes the epoch it resumes in as ``global_step // update_steps_per_epoch``; the
    same count is used here, so the resumed epoch is the right one even where the loader the Trainer
    iterates (rebuilt by ``skip_first_batches``) does not forward ``set_epoch`` to the sampler.
    """

    def __init__(self, trainer: TorchreproTrainerMixin) -> None:
        self._trainer = trainer
        self._next_epoch = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _warn_unless_deterministic(args)
        loader = kwargs.get("train_dataloader")
        if isinstance(loader, StreamingLoader):
            return  # its epochs follow its own position (TorchreproStreamPosition)
        accumulation = max(int(args.gradient_accumulation_steps), 1)
        per_epoch = max(math.ceil(len(loader) / accumulation), 1) if loader is not None else 1
        self._next_epoch = int(state.global_step) // per_epoch

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = self._trainer.seeded_train_loader
        if loader is not None and not isinstance(loader, StreamingLoader):
            loader.set_epoch(self._next_epoch)
        self._next_epoch += 1


class _TrainerStream(StreamingLoader):
    """A streamed ``SeededLoader`` as the Trainer iterates it.

    The Trainer cannot count a stream's epochs: it numbers its passes from 0 in every ``train()``
    call, resumed or not. ``set_epoch(k)`` selects epoch ``first_epoch + k``, ``first_epoch``
    being the epoch of the position ``TorchreproStreamPosition`` restored (0 when none was).
    """

    first_epoch = 0
    restores = True  # False with the user's TrainingArguments(ignore_data_skip=True)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(self.first_epoch + epoch)


class TorchreproStreamPosition(transformers.TrainerCallback, transformers.trainer_callback.ExportableState):
    """Saves a streamed train loader's position in every checkpoint, and restores it on resume
    (``TorchreproTrainerMixin`` adds it; its class name is the key in ``trainer_state.json``).

    The position travels in ``trainer_state.json`` (``stateful_callbacks``), which every process
    reads on resume; it is the same on every process (the steps of a stream are shared by rank).
    It is restored when training starts, before the first batch is fetched; a position at the
    end of its epoch (nothing left to train in it) continues with the next epoch, since the
    Trainer stops training at a pass that yields nothing.
    """

    def __init__(self) -> None:
        self._loader: _TrainerStream | None = None

    def state(self) -> dict[str, Any]:
        """The loader's position now, as JSON (``None`` for a map-style loader)."""
        position = self._loader.state_dict() if self._loader is not None else None
        return {"args": {}, "attributes": {"position": position}}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = kwargs.get("train_dataloader")
        self._loader = loader if isinstance(loader, _TrainerStream) else None
        name = type(self).__name__
        saved = state.stateful_callbacks.get(name)
        state.stateful_callbacks[name] = self.state()  # a checkpoint saved without it has no entry
        if self._loader is None or state.global_step == 0 or not self._loader.restores:
            return
        if isinstance(saved, list):
            saved = saved[0] if saved else None
        attributes = saved.get("attributes") if isinstance(saved, Mapping) else None
        position = attributes.get("position") if isinstance(attributes, Mapping) else None
        if position is None:
            warn_once(
                "transformers-no-stream-position",
                f"Resuming at step {state.global_step} from a checkpoint without the position of the "
                "streamed train data (saved without TorchreproTrainer, or of a map-style dataset): "
                "the stream starts again at the first sample of epoch 0, so the resumed run trains "
                "other batches than an uninterrupted one. Resume from a checkpoint TorchreproTrainer "
                "saved with the same train dataset.",
                ReproWarning,
                stacklevel=2,
            )
            return
        loader = self._loader
        loader.load_state_dict(position)
        epoch = loader.epoch
        if loader._rest_is_empty():
            epoch += 1
            StreamingLoader.set_epoch(loader, epoch)
        loader.first_epoch = epoch


def _warn_unless_deterministic(args: Any) -> None:
    """Name the determinism switches that fall short of strict mode, once per process."""
    from torchrepro.errors import ReproWarning, warn_once
    from torchrepro.status_report import status

    if getattr(args, "full_determinism", False):
        return  # the Trainer's own enable_full_determinism set them
    short = [item for item in status().shortfalls if not item.process_start]
    if not short:
        return
    names = ", ".join(item.name for item in short)
    warn_once(
        "transformers-switches",
        f"TorchreproTrainer trains with determinism switches short of strict mode ({names}): the "
        "train loader is seeded, but on CUDA the kernels may still differ from run to run. "
        "TorchreproTrainer does not set them itself: they are process-wide, and cuBLAS reads "
        "CUBLAS_WORKSPACE_CONFIG once, when CUDA starts (the Trainer has already placed the model). "
        "Call torchrepro.set_determinism('strict') at the top of the script, or start it with "
        "`torchrepro run`.",
        ReproWarning,
        stacklevel=2,
    )


class TorchreproTrainerMixin(_TrainerBase):
    """Makes a Hugging Face ``Trainer``'s train loader a ``torchrepro.SeededLoader``.

    Put it first: ``class MyTrainer(TorchreproTrainerMixin, SFTTrainer)``, or use
    :class:`TorchreproTrainer`. The train loader then has the ``SeededLoader`` guarantees: the same
    batches for any ``dataloader_num_workers``, each process its shard, and
    ``trainer.train(resume_from_checkpoint=...)`` continues mid-epoch exactly (the Trainer skips
    the batches already trained by index and restores its saved RNG state), with any
    ``gradient_accumulation_steps``. The seed is ``args.data_seed``, or ``args.seed`` when it is
    ``None``.

    A streamed train dataset, ``torchrepro.ShardedDataset(shards, read_shard)`` or a Hugging Face
    ``datasets.IterableDataset`` (streamed as ``ShardedDataset.from_hf(dataset)``), is loaded by
    a streamed ``SeededLoader`` with ``shuffle_buffer`` samples in its shuffle buffer (the
    keyword of this ``__init__``; default ``torchrepro.data.streaming.DEFAULT_SHUFFLE_BUFFER``):
    it needs ``TrainingArguments(max_steps=...)``, and its checkpoints hold the stream's position,
    which a resume restores (no sample is read again to skip it). With ``partitions=P`` (also a
    keyword of this ``__init__``) each process reads only its partitions' shards
    (``SeededLoader(..., partitions=P)``, a global batch being one optimizer step over all
    processes, ``drop_last`` on); a filtered, packed or mixed stream is loaded whole by every
    process without it.

    Settings the loader cannot honour are refused with the setting to change:
    ``train_sampling_strategy`` other than ``"random"``/``"sequential"``,
    ``dataloader_in_order=False``, and a stream without ``max_steps``. Evaluation loaders are the
    Trainer's own.
    Determinism switches are left alone: call ``torchrepro.set_determinism("strict")`` at the top
    of the script, or start it with ``torchrepro run``.
    """

    def __init__(
        self, *args: Any, shuffle_buffer: int | None = None, partitions: int | None = None, **kwargs: Any
    ) -> None:
        _check_stream_arguments(super().__init__, args, kwargs)
        self.shuffle_buffer = shuffle_buffer
        self.partitions = partitions
        # (our copy of the arguments, the caller's ignore_data_skip): see get_train_dataloader
        self._tr_args_copy: tuple[Any, bool] = (None, False)
        super().__init__(*args, **kwargs)
        self.seeded_train_loader: SeededLoader | None = None
        self.add_callback(_SeededEpochs(self))
        self.add_callback(TorchreproStreamPosition())

    def get_train_dataloader(self) -> Any:
        """The train loader: a ``SeededLoader`` (not passed to ``accelerator.prepare``)."""
        if self.train_dataset is None:
            return super().get_train_dataloader()  # the Trainer's own error
        args = self.args
        shuffle = self._check_settings(args)
        dataset, collator = self.train_dataset, self.data_collator
        datasets: Any = sys.modules.get("datasets")  # a datasets.Dataset means it is imported
        stream = _stream(dataset)
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        loader_class: type[SeededLoader] = SeededLoader
        streaming: dict[str, Any] = {}
        if stream is not None:
            _check_max_steps(args.max_steps)
            dataset, loader_class = stream, _TrainerStream
            streaming["shuffle_buffer"] = self.shuffle_buffer
            if self.partitions is not None:  # a global batch is an optimizer step over all processes
                accumulation = max(int(args.gradient_accumulation_steps), 1)
                streaming["partitions"] = self.partitions
                streaming["global_batch_size"] = self._train_batch_size * args.world_size * accumulation
        elif self.partitions is not None:
            raise LoaderConfigError(
                f"TorchreproTrainer(partitions={self.partitions}) is for a streamed train dataset (a "
                f"torchrepro.ShardedDataset or a datasets.IterableDataset); {type(dataset).__name__} is "
                "map-style: drop partitions."
            )
        elif self.shuffle_buffer is not None:
            raise LoaderConfigError(
                f"TorchreproTrainer(shuffle_buffer={self.shuffle_buffer}) is for a streamed train dataset "
                f"(a torchrepro.ShardedDataset or a datasets.IterableDataset); {type(dataset).__name__} "
                "is map-style, shuffled whole each epoch: drop shuffle_buffer."
            )
        loader = loader_class(
            dataset,
            batch_size=self._train_batch_size,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            shuffle=shuffle,
            num_workers=args.dataloader_num_workers,
            drop_last=args.dataloader_drop_last or "partitions" in streaming,
            collate_fn=collator,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=getattr(args, "dataloader_multiprocessing_context", None),
            **streaming,
        )
        # The Trainer's fast-forward would iterate a stream from its start: the loader restores its
        # own position instead, and the Trainer gets a copy of its arguments with ignore_data_skip
        # (the caller's stay as given).
        copied, given = self._tr_args_copy
        if args is not copied:
            given = args.ignore_data_skip
        if isinstance(loader, _TrainerStream):
            loader.restores = not given
            if not args.ignore_data_skip:
                self.args = args = copy.copy(args)
                args.ignore_data_skip = True
                self._tr_args_copy = (args, given)
        elif args is copied:
            args.ignore_data_skip = given  # the copy, for a map-style dataset now
        self.seeded_train_loader = loader
        return loader

    @staticmethod
    def _check_settings(args: Any) -> bool:
        """Refuse what a ``SeededLoader`` cannot honour; return ``shuffle``."""
        strategy = getattr(args, "train_sampling_strategy", "random")
        if getattr(args, "group_by_length", False):  # transformers < 5
            strategy = "group_by_length"
        if strategy not in _SAMPLING:
            raise LoaderConfigError(
                f"TorchreproTrainer loads training data with a torchrepro.SeededLoader, which draws its "
                f"own order from (seed, epoch); train_sampling_strategy={strategy!r} needs the "
                "Trainer's own sampler. Set TrainingArguments(train_sampling_strategy='random') "
                "(or 'sequential'), or use the stock Trainer."
            )
        if getattr(args, "dataloader_in_order", True) is not True:
            raise LoaderConfigError(
                "TorchreproTrainer needs TrainingArguments(dataloader_in_order=True): with False, "
                "batches arrive in the order workers finish them, which depends on timing."
            )
        return _SAMPLING[strategy]


def _stream(dataset: Any) -> ShardedDataset | None:
    """The ``ShardedDataset`` a train dataset streams from: itself, or a Hugging Face
    ``datasets.IterableDataset``'s shards; ``None`` for any other dataset."""
    if isinstance(dataset, ShardedDataset):
        return dataset
    datasets: Any = sys.modules.get("datasets")
    if datasets is not None and isinstance(dataset, datasets.IterableDataset):
        return ShardedDataset.from_hf(dataset)
    return None


def _check_max_steps(max_steps: int) -> None:
    if max_steps <= 0:
        raise LoaderConfigError(
            "TorchreproTrainer streams this train dataset (a torchrepro.ShardedDataset or a "
            "datasets.IterableDataset): its length is known only once it is read, so the Trainer "
            f"cannot count the steps of an epoch, and TrainingArguments(max_steps={max_steps}) leaves "
            "the number of steps unknown. Pass TrainingArguments(max_steps=N): training runs N "
            "optimizer steps, through as many epochs of the stream as they take."
        )


def _check_stream_arguments(init: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a streamed train dataset without ``max_steps`` before the Trainer does (its error
    does not say what a stream needs)."""
    try:
        bound = inspect.signature(init).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return  # the Trainer reports its own arguments
    training_args = bound.get("args")
    if training_args is not None and _stream(bound.get("train_dataset")) is not None:
        _check_max_steps(getattr(training_args, "max_steps", 0))


class TorchreproTrainer(TorchreproTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with :class:`TorchreproTrainerMixin`: a seeded, resumable train loader.

    ``TorchreproTrainer(model=model, args=TrainingArguments(...), train_dataset=dataset)``, then
    ``trainer.train()`` or ``trainer.train(resume_from_checkpoint=True)``.
    """
