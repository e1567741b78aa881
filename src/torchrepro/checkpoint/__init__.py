"""Checkpoints that bring back every bit: model, optimizer, scheduler, scaler, data position, RNG.

One module per job, each stating its invariants:

- ``checkpoint.format``: what a file holds (marker, format version, object kinds, rank file
  names, the save clock, the environment record, packing) and the checksums of its states.
- ``checkpoint.writing``: ``save_checkpoint`` (atomic, durable now or in the background),
  ``wait_for_checkpoints``, and what a failed write or background fsync is reported as.
- ``checkpoint.reading``: reading untrusted files (one open file, size limits, errors naming the
  file and the cause) and ``latest_checkpoint``.
- ``checkpoint.restore``: ``load_checkpoint``, which checks everything it can before copying into
  the objects and restores the RNG state last.

Submodules load lazily on first use of a public name: importing this package imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro.checkpoint.format import FORMAT_VERSION
    from torchrepro.checkpoint.reading import latest_checkpoint, prune_checkpoints
    from torchrepro.checkpoint.restore import load_checkpoint
    from torchrepro.checkpoint.writing import save_checkpoint, wait_for_checkpoints

__all__ = [
    "FORMAT_VERSION",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "save_checkpoint",
    "wait_for_checkpoints",
]

_WHERE = {
    "FORMAT_VERSION": "format",
    "latest_checkpoint": "reading",
    "prune_checkpoints": "reading",
    "load_checkpoint": "restore",
    "save_checkpoint": "writing",
    "wait_for_checkpoints": "writing",
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, __all__)
