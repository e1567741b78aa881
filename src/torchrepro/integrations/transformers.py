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

import importlib
import math
import sys
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
from torchrepro.errors import LoaderConfigError

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
        accumulation = max(int(args.gradient_accumulation_steps), 1)
        per_epoch = max(math.ceil(len(loader) / accumulation), 1) if loader is not None else 1
        self._next_epoch = int(state.global_step) // per_epoch

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = self._trainer.seeded_train_loader
        if loader is not None:
            loader.set_epoch(self._next_epoch)
        self._next_epoch += 1


def _warn_unless_deterministic(args: Any) -> None:
    """Name the determinism switches that fall short of strict mode, once per process."""
    from torchrepro.errors import ReproWarning, warn_once
    from torchrepro.flags import status

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

    Settings the loader cannot honour are refused with the setting to change:
    ``train_sampling_strategy`` other than ``"random"``/``"sequential"``,
    and ``dataloader_in_order=False``. Evaluation loaders are the Trainer's own.
    Determinism switches are left alone: call ``torchrepro.set_determinism("strict")`` at the top
    of the script, or start it with ``torchrepro run``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seeded_train_loader: SeededLoader | None = None
        self.add_callback(_SeededEpochs(self))

    def get_train_dataloader(self) -> Any:
        """The train loader: a ``SeededLoader`` (not passed to ``accelerator.prepare``)."""
        if self.train_dataset is None:
            return super().get_train_dataloader()  # the Trainer's own error
        args = self.args
        shuffle = self._check_settings(args)
        dataset, collator = self.train_dataset, self.data_collator
        datasets: Any = sys.modules.get("datasets")  # a datasets.Dataset means it is imported
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        loader = SeededLoader(
            dataset,
            batch_size=self._train_batch_size,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            shuffle=shuffle,
            num_workers=args.dataloader_num_workers,
            drop_last=args.dataloader_drop_last,
            collate_fn=collator,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=getattr(args, "dataloader_multiprocessing_context", None),
        )
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


class TorchreproTrainer(TorchreproTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with :class:`TorchreproTrainerMixin`: a seeded, resumable train loader.

    ``TorchreproTrainer(model=model, args=TrainingArguments(...), train_dataset=dataset)``, then
    ``trainer.train()`` or ``trainer.train(resume_from_checkpoint=True)``.
    """
