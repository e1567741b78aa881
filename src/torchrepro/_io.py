"""Atomic file writes: every file torchrepro saves goes through here.

Invariants:
- A crash at any moment leaves either the old file or the complete new one at ``path``, never a
  torn one: data goes to a temporary file in the same directory, is fsynced, then renamed over
  ``path`` with ``os.replace``, and the directory is fsynced. A failed write removes the
  temporary file and leaves ``path`` as it was.
- Files get the mode ``open()`` and ``torch.save`` give (``0o666`` less the umask, and the
  directory's default ACL): the temporary file is created with ``0o666`` and the kernel applies
  the umask, so the process-global umask is never read or changed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["TMP_SUFFIX", "atomic_open", "atomic_torch_save", "atomic_write_bytes", "atomic_write_json"]

TMP_SUFFIX = ".tmp-torchrepro"
"""Suffix of in-progress temporary files (``latest_checkpoint`` and friends ignore them)."""


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)


def _create_temporary(directory: Path, name: str) -> tuple[int, Path]:
    """A new file ``.<name>.<random><TMP_SUFFIX>`` in ``directory``, opened for writing.

    Unlike ``tempfile.mkstemp`` (always ``0o600``) it is created with ``0o666`` and the kernel
    applies the umask, like ``open(path, "w")``.
    """
    for _ in range(100):
        tmp = directory / f".{name}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            return os.open(tmp, _CREATE_FLAGS, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"No unused temporary file name beside {directory / name} after 100 tries.")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``; on a clean exit it atomically becomes ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open supports modes 'wb' and 'w', got {mode!r}")
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temporary(directory, target.name)
    try:
        f: IO[Any]
        f = os.fdopen(fd, "wb") if mode == "wb" else os.fdopen(fd, "w", encoding="utf-8")
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(directory)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON (UTF-8, sorted keys, trailing newline) to ``path`` atomically."""
    text = json.dumps(obj, indent=indent, sort_keys=True, allow_nan=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(path: str | os.PathLike[str], obj: Any) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically (serialised in memory first)."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getbuffer().tobytes())
