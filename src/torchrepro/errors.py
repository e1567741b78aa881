"""Errors and warnings raised by torchrepro.

Invariants: every exception the library raises on purpose is a ``ReproError`` (or a built-in
``TypeError``/``ValueError`` for plainly wrong arguments), except the one failure of a test,
``ReproAssertionError`` (an ``AssertionError``); every warning is a ``ReproWarning``,
emitted at most once per process per key, with ``stacklevel`` pointing at the user's line.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchrepro.results import CheckResult

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "DataLoaderStateError",
    "DeterminismError",
    "EnvFileError",
    "InvariantTrainingError",
    "LaunchError",
    "LoaderConfigError",
    "ReproAssertionError",
    "ReproError",
    "ReproWarning",
    "RngStateError",
    "SettingsError",
    "ShardReadError",
    "TraceError",
    "UnsupportedDatasetError",
    "warn_once",
]


class ReproError(RuntimeError):
    """Base class of every error torchrepro raises on purpose."""


class DeterminismError(ReproError):
    """A determinism setting cannot be applied (for example CUDA started before CUBLAS was set)."""


class RngStateError(ReproError):
    """An RNG state cannot be captured, restored or parsed."""


class DataLoaderStateError(ReproError):
    """A loader state does not fit the loader it is loaded into."""


class LoaderConfigError(ReproError, ValueError):
    """A ``SeededLoader`` argument conflicts with what seeded loading needs (or no seed is known)."""


class UnsupportedDatasetError(ReproError, TypeError):
    """The dataset cannot be loaded by ``SeededLoader`` (for example an ``IterableDataset``)."""


class InvariantTrainingError(ReproError):
    """``InvariantDataParallel`` or ``clip_grad_norm_`` cannot keep the result independent of the
    world size (a module it cannot order, a micro-batch without its backward, a second backward,
    an FSDP2 mesh it cannot reduce over, a non-finite total norm...)."""


class ShardReadError(ReproError):
    """A shard of a ``ShardedDataset`` failed to open or to read (the message names it)."""


class CheckpointError(ReproError):
    """A checkpoint cannot be written, read, or does not match what it is loaded into."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint cannot be written (no space left, a file-size limit, no permission...).

    Also an ``OSError`` with the ``errno`` of the failed write, so code that handles a full disk
    as an ``OSError`` keeps working; the previous file at the path is left as it was.
    """


class LaunchError(ReproError):
    """A script or module cannot be launched as asked."""


class SettingsError(LaunchError, ValueError):
    """A run setting (seed, mode, threads, steps...) is invalid; refused before anything starts."""


class TraceError(ReproError):
    """An op trace cannot be recorded, read or compared."""


class EnvFileError(ReproError):
    """An environment or run-record file is unreadable or malformed."""


class ReproAssertionError(AssertionError):
    """``torchrepro.testing.assert_reproducible`` failed: the runs differ, the verdict is
    inconclusive, or the training failed. The message is the verdict in words.

    An ``AssertionError`` (a test failure), not a ``ReproError``. ``target`` names what was checked;
    ``results`` holds the verdict of every check made (``CheckResult``, the failing one last) and
    ``varied`` what each one varied (its ``vary``: ``None`` for plain runs, a setting's name, or
    the keyword arguments of a function's later runs).
    """

    def __init__(
        self,
        message: str,
        *,
        target: str = "",
        results: tuple[CheckResult, ...] = (),
        varied: tuple[object, ...] = (),
    ) -> None:  # defaults: unpickling calls cls(message), then restores the attributes
        super().__init__(message)
        self.target = target
        self.results = results
        self.varied = varied


class ReproWarning(UserWarning):
    """Base class of every warning torchrepro emits."""


_warned: set[str] = set()


def warn_once(key: str, message: str, category: type[Warning] = ReproWarning, *, stacklevel: int = 2) -> bool:
    """Emit ``message`` once per process for ``key``; return whether it was emitted.

    ``stacklevel`` counts from the caller of ``warn_once`` (2 = the caller's caller).
    """
    if key in _warned:
        return False
    _warned.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    return True
