"""Lightning integration: ``TorchreproCallback``, a ``lightning.pytorch.Callback``.

Invariants:
- Importing this module imports ``lightning.pytorch``; nothing else in torchrepro does. Without
  the ``lightning`` package it raises ``ModuleNotFoundError`` naming the extra to install.
- At ``setup`` every rank is seeded and switched, once per ``Trainer`` call. Under
  ``torchrepro run`` (a seeded child spec) the run's seed and mode win: a bootstrapped process
  is only checked, a rank the framework started itself gets the run's seed and mode.
- Every checkpoint Lightning writes holds every rank's ``RngState`` (gathered on all ranks, so
  whichever rank writes has them all), as plain data that ``torch.load(weights_only=True)``
  reads. ``trainer.fit(ckpt_path=...)`` restores this rank's state in the first
  ``on_train_batch_start``: after everything Lightning does on a restore (set-up hooks, building
  and positioning the dataloaders, creating the iterator of a validation pass it skips, which
  draws from torch's global RNG) and after the batch is fetched (a ``SeededLoader`` leaves the
  global streams as they were), so the first resumed step draws what the uninterrupted run drew.
- During ``fit``, validation (and the sanity check) never moves the RNG streams training draws
  from: after a validation pass they are put back as this callback's ``on_train_batch_end`` saw
  them (after the sanity check, as they were before it). So a
  checkpoint written right before a validation pass (``every_n_train_steps`` at an epoch's end)
  resumes like any other, and adding validation does not shift training.
- At the start of ``fit``, a train loader that is a plain ``torch.utils.data.DataLoader`` (not a
  ``SeededLoader``) is named in one ``ReproWarning`` per process: Lightning cannot put such a
  loader back mid-epoch, so a resume from a mid-epoch checkpoint trains other batches.
- A ``SeededLoader`` position in a checkpoint is where the training loop is. For a train loader
  without ``len()`` (a streamed ``SeededLoader(ShardedDataset(...))``) Lightning's fetcher runs one
  batch ahead of the loop, so ``on_save_checkpoint`` takes the batches the fetcher holds off the
  position Lightning saved. A pass the fetcher found ended (the loop at the epoch's last batch,
  which Lightning then resumes in the next epoch) stays ended.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchrepro.errors import ReproWarning, RngStateError, warn_once
from torchrepro.flags import MODES
from torchrepro.rng import RngState
from torchrepro.seeding import validate_seed

__all__ = ["STATE_VERSION", "TorchreproCallback"]

STATE_VERSION = 1
"""Version of the callback's checkpoint entry; ``load_state_dict`` refuses versions it does not know."""

_INSTALL = "pip install torchrepro[lightning]"


def _lightning() -> Any:
    try:
        import lightning.pytorch as pl
    except ModuleNotFoundError as exc:
        if exc.name not in ("lightning", "lightning.pytorch"):
            raise
        try:
            import pytorch_lightning  # noqa: F401
        except ModuleNotFoundError:
            hint = ""
        else:
            hint = (
                " (pytorch_lightning is installed, but TorchreproCallback is a lightning.pytorch "
                "Callback: install lightning and import Trainer from lightning.pytorch)"
            )
        raise ModuleNotFoundError(
            f"torchrepro.integrations.lightning needs Lightning, which is not installed{hint}; "
            f"install it with `{_INSTALL}`.",
            name="lightning",
        ) from None
    return pl


if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule, Trainer
else:
    Callback = _lightning().Callback


def _check_mode(mode: object) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}.")
    return mode


def _bootstrapped_and_seeded() -> bool:
    """Whether ``torchrepro run`` seeded this very process (not merely left its variables here)."""
    from torchrepro import _runtime

    return _runtime.bootstrapped(seeded=True)


def _gather(local: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """Every rank's ``local``, in rank order (a collective: every rank must call it)."""
    if world_size == 1:
        return [local]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RngStateError(
            f"TorchreproCallback cannot gather the RNG states of {world_size} ranks: torch.distributed "
            "is not initialised. Save checkpoints from inside trainer.fit (e.g. with ModelCheckpoint)."
        )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def _plain_loaders(loaders: Any) -> list[str]:
    """The plain ``DataLoader`` objects among the train loaders (one, or a list/dict of them)."""
    from torch.utils.data import DataLoader

    from torchrepro.data import SeededLoader

    found: list[str] = []

    def visit(obj: Any, where: str) -> None:
        if isinstance(obj, Mapping):
            for key, value in obj.items():
                visit(value, f"{where}[{key!r}]")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                visit(value, f"{where}[{i}]")
        elif isinstance(obj, DataLoader) and not isinstance(obj, SeededLoader):
            found.append(f"{where}: {type(obj).__name__} over {type(obj.dataset).__name__}")

    visit(loaders, "train_dataloader()")
    return found


def _loop_positions(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Put the positions of the ``SeededLoader`` train loaders in ``checkpoint`` where the training
    loop is, not where Lightning's fetcher is.

    For a train loader without ``len()`` (a streamed ``SeededLoader``) Lightning fetches one batch
    ahead of the loop, to know which batch is the epoch's last, so the position the loader counts
    is one batch past the batch just trained, and at the epoch's last batch the loader's pass has
    ended. The entry saved is the position after the batches the loop took, inside the epoch; the
    resumed fit then continues the epoch (an empty rest ends it, and Lightning's ``set_epoch`` for
    the next epoch starts that one from its first batch).
    """
    from torchrepro.data import SeededLoader
    from torchrepro.data.streaming import StreamingLoader

    if trainer.state.fn != "fit":
        return
    fit_loop = trainer.fit_loop
    combined = getattr(fit_loop, "_combined_loader", None)
    loops = checkpoint.get("loops")
    states = loops.get("fit_loop", {}).get("state_dict", {}).get("combined_loader") if loops else None
    if combined is None or not isinstance(states, list):
        return
    # The loaders Lightning saved a state of, in its order (its `_Stateful` test).
    stateful = [
        loader
        for loader in combined.flattened
        if all(callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict"))
    ]
    if len(stateful) != len(states):
        return
    # Batches fetched and not yet given to the loop (the prefetching fetcher holds them).
    ahead = len(getattr(getattr(fit_loop, "_data_fetcher", None), "batches", None) or ())
    for i, (loader, state) in enumerate(zip(stateful, states, strict=True)):
        if not isinstance(loader, SeededLoader) or not isinstance(state, dict):
            continue
        batches = state.get("batches_consumed")
        if not isinstance(batches, int) or batches < ahead:
            continue  # the fetcher began another pass: nothing to put back
        if not ahead:
            continue
        if isinstance(loader, StreamingLoader):
            states[i] = loader._state(batches - ahead, finished=False)
        else:
            states[i] = {**state, "batches_consumed": batches - ahead, "finished": False}


class TorchreproCallback(Callback):
    """Seed and set the determinism switches on every rank; save and restore every rank's RNG state.

    ``Trainer(callbacks=[TorchreproCallback(seed=0)])``:

    - **setup** (every rank, each ``fit``/``validate``/``test``/``predict``):
      ``torchrepro.seed_everything(seed)`` and ``torchrepro.set_determinism(mode)``. Under
      ``torchrepro run`` the run's seed and mode are kept (a ``ReproWarning`` says so when they
      differ from the callback's), and the switches are only checked. Seeding happens after the
      ``LightningModule`` was created: seed before creating it (or create its layers in
      ``configure_model``) for reproducible initial weights.
    - **checkpoints**: every checkpoint holds every rank's ``RngState`` (Python, NumPy, torch
      CPU and CUDA), gathered from all ranks; it loads with ``torch.load(weights_only=True)``.
    - **resume** (``trainer.fit(ckpt_path=...)``): each rank's state is restored right before
      the first resumed training step (``on_train_batch_start``), so the run draws the random
      numbers the uninterrupted run drew. Resuming with a different number of ranks raises
      ``RngStateError``; a checkpoint without the state warns.
    - **validation** during ``fit`` (and the sanity check) leaves the training streams as the
      last training batch left them, so checkpoints written right before a validation pass
      resume exactly too, and adding validation does not shift training.

    Batches resume exactly when ``train_dataloader()`` returns a ``torchrepro.SeededLoader``
    (Lightning saves its position; its batches never move the global streams), over a map-style
    dataset or streamed from a ``torchrepro.ShardedDataset`` (with ``limit_train_batches`` an
    int, or none; each checkpoint holds the position of the batches the loop took, though
    Lightning fetches ahead of the loop for a loader without ``len()``); a plain ``DataLoader``
    is named in a ``ReproWarning`` at the start of ``fit``. Randomness drawn
    in hooks between a checkpoint and the next training step (``on_train_batch_end`` after the
    save, ``on_train_epoch_start``) is not drawn again by the resumed run.
    """

    def __init__(self, seed: int = 0, mode: str = "strict") -> None:
        super().__init__()
        self.seed = validate_seed(seed)
        self.mode = _check_mode(mode)
        self._trainer: Trainer | None = None
        self._pending: RngState | None = None  # this rank's state, loaded, not yet restored
        self._loaded = False
        self._training_rng: RngState | None = None  # the streams validation must leave as they are
        self._sanity_rng: RngState | None = None

    # -- setup: seeds and switches ------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Seed every RNG and set the switches (or check those of ``torchrepro run``)."""
        self._trainer = trainer
        self._pending, self._loaded = None, False  # a state loaded by an earlier call is stale
        self._training_rng = None
        from torchrepro.protocol import ChildSpec

        spec = ChildSpec.from_env()
        if not spec.seeded:
            self._apply(self.seed, self.mode)
            return
        assert spec.seed is not None and spec.mode is not None
        if (spec.seed, spec.mode) != (self.seed, self.mode):
            warn_once(
                "lightning-run-settings",
                f"TorchreproCallback(seed={self.seed}, mode={self.mode!r}) runs under `torchrepro run "
                f"--seed {spec.seed} --mode {spec.mode}`: the run's seed and mode are kept. Give the "
                "callback the same values (or change the run's) to silence this.",
                ReproWarning,
                stacklevel=3,
            )
        if not _bootstrapped_and_seeded():
            # A rank the framework started itself (Lightning's DDP launcher runs `python script.py`
            # again): it inherited the run's variables but not its seeding.
            self._apply(spec.seed, spec.mode)
            return
        from torchrepro.status_report import status

        now = status().mode
        if now != spec.mode:
            warn_once(
                "lightning-run-switches",
                f"The determinism switches are {now!r}, not {spec.mode!r} as `torchrepro run --mode "
                f"{spec.mode}` set them: something in the script changed them before trainer setup. "
                "Remove that change, or run with the --mode that matches it.",
                ReproWarning,
                stacklevel=3,
            )

    @staticmethod
    def _apply(seed: int, mode: str) -> None:
        from torchrepro.flags import set_determinism
        from torchrepro.seeding import seed_everything

        seed_everything(seed)
        set_determinism(mode)

    # -- checkpoints: every rank's RNG state -------------------------------------------------

    def _ranks(self) -> tuple[int, int]:
        trainer = self._trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def state_dict(self) -> dict[str, Any]:
        """Every rank's RNG state now (a collective under DDP: Lightning calls it on every rank)."""
        _, world_size = self._ranks()
        states = _gather(RngState.capture().to_dict(), world_size)
        return {"version": STATE_VERSION, "world_size": len(states), "rng": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check the saved states against this run and keep this rank's for the first resumed step."""
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != STATE_VERSION:
            version = state_dict.get("version") if isinstance(state_dict, Mapping) else None
            raise RngStateError(
                f"The checkpoint's TorchreproCallback entry has version {version!r}; this torchrepro "
                f"reads version {STATE_VERSION}. Resume with the torchrepro that wrote it."
            )
        states = state_dict.get("rng")
        if not isinstance(states, list) or state_dict.get("world_size") != len(states):
            raise RngStateError(
                "The checkpoint's TorchreproCallback entry is malformed (expected 'world_size' and one "
                "'rng' state per rank); resume from a checkpoint this callback wrote."
            )
        rank, world_size = self._ranks()
        if len(states) != world_size:
            raise RngStateError(
                f"The checkpoint holds the RNG states of {len(states)} rank(s), but this run has "
                f"{world_size}. Resume with {len(states)} process(es) (Trainer devices x num_nodes), "
                "as the run that saved it; or, to resume without restoring RNG states (the run then "
                "differs from an uninterrupted one), delete checkpoint['callbacks']"
                f"[{self.state_key!r}] from the file."
            )
        self._pending = RngState.from_dict(states[rank])
        self._loaded = True

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Save each streamed train loader's position as the training loop consumed it."""
        _loop_positions(trainer, checkpoint)

    # -- resume ------------------------------------------------------------------------------

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Warn about plain train loaders, and when resuming from a checkpoint without RNG states."""
        plain = _plain_loaders(trainer.train_dataloader)
        if plain:
            warn_once(
                "lightning-plain-loader",
                f"The train loader is a plain torch DataLoader ({', '.join(plain)}): Lightning cannot "
                "put it back at the batch a mid-epoch checkpoint was saved at, so a resume from one "
                "trains other batches than the uninterrupted run (and with shuffling or workers, "
                "its order depends on the global RNG). Return a torchrepro.SeededLoader from "
                "train_dataloader() (same arguments) to resume exactly.",
                ReproWarning,
                stacklevel=3,
            )
        if trainer.ckpt_path is not None and not self._loaded:
            warn_once(
                "lightning-no-rng-state",
                f"Resuming from {trainer.ckpt_path} without RNG states: the checkpoint has no "
                "TorchreproCallback entry (saved without the callback, or with save_weights_only=True), "
                "so the resumed run draws different random numbers than an uninterrupted one. Save "
                "checkpoints with TorchreproCallback in the Trainer's callbacks.",
                ReproWarning,
                stacklevel=3,
            )

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        """Restore this rank's saved RNG state right before the first resumed training step."""
        if self._pending is not None:
            state, self._pending = self._pending, None
            state.restore()

    # -- validation leaves the training streams alone -----------------------------------------

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        """Remember the streams as training left them, for the validation pass that may follow."""
        if trainer.enable_validation:
            self._training_rng = RngState.capture()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Put back the streams of the last training batch: validation draws leave no trace."""
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self._training_rng is not None:
            self._training_rng.restore()

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Remember the streams before the sanity check's validation batches."""
        self._sanity_rng = RngState.capture()

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Put the streams back: the sanity check does not shift training."""
        state, self._sanity_rng = self._sanity_rng, None
        if state is not None:
            state.restore()
