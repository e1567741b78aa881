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

import atexit
import contextlib
import errno
import io
import json
import os
import secrets
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "TMP_SUFFIX",
    "BackgroundSyncError",
    "atomic_open",
    "atomic_torch_save",
    "atomic_write_bytes",
    "atomic_write_json",
    "pending_paths",
    "wait_pending",
]

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
def atomic_open(
    path: str | os.PathLike[str], mode: str = "wb", *, background: bool = False
) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``; on a clean exit it atomically becomes ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was. With
    ``background`` and no file at ``path``, the complete file appears at ``path`` before it is
    fsynced, and the fsyncs run in a background thread (see the module's invariants).
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
            if background and _publish_now(f.fileno(), tmp, target, directory):
                return
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(directory)


# --------------------------------------------------------------------------- background fsync


class BackgroundSyncError(OSError):
    """A file made visible before it was durable could not be fsynced; it was removed from its path.

    ``path`` is the file, ``errno`` and ``strerror`` those of the failed fsync."""

    def __init__(self, path: Path, cause: OSError, others: int = 0) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause) or type(cause).__name__)
        self.path = path
        self.cause = cause
        self.others = others


@dataclass(eq=False)
class _Pending:
    path: Path
    directory: Path
    fd: int
    ident: tuple[int, int]  # (st_dev, st_ino) of the file written
    done: threading.Event = field(default_factory=threading.Event)
    error: OSError | None = None


_lock = threading.Lock()
_pending: list[_Pending] = []
_failed: list[_Pending] = []  # finished with an error not yet raised
_atexit_registered = False


def _publish_now(fd: int, tmp: Path, target: Path, directory: Path) -> bool:
    """Link the complete ``tmp`` to ``target`` and fsync both in the background; ``False`` (and
    nothing done) when ``target`` exists or hard links are not supported: the caller then writes
    synchronously."""
    global _atexit_registered
    try:
        os.link(tmp, target)  # atomic, and never replaces anything: EEXIST if target exists
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            return False
        raise
    info = os.fstat(fd)
    pending = _Pending(target, directory, os.dup(fd), (info.st_dev, info.st_ino))
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    with _lock:
        _pending.append(pending)
        if not _atexit_registered:
            atexit.register(_wait_at_exit)
            _atexit_registered = True
    threading.Thread(target=_finish, args=(pending,), name="torchrepro-fsync", daemon=True).start()
    return True


def _finish(pending: _Pending) -> None:
    """Background thread: fsync the file and its directory; on failure withdraw the file."""
    try:
        os.fsync(pending.fd)
        try:
            fd = os.open(pending.directory, os.O_RDONLY)
        except FileNotFoundError:  # the directory was removed since: nothing left to keep
            fd = -1
        if fd >= 0:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except OSError as e:
        pending.error = e
        _withdraw(pending)
    finally:
        os.close(pending.fd)
        with _lock:
            if pending in _pending:  # not if a fork in this thread's process cleared the list
                _pending.remove(pending)
                if pending.error is not None:
                    _failed.append(pending)
        pending.done.set()


def _withdraw(pending: _Pending) -> None:
    """Remove a file whose fsync failed from its path, if the path still names that file: its
    bytes may never reach the disk, so nothing may find it there after a crash or read it now."""
    with contextlib.suppress(OSError):
        info = os.stat(pending.path, follow_symlinks=False)
        if (info.st_dev, info.st_ino) == pending.ident:
            pending.path.unlink()
            _fsync_dir(pending.directory)


def pending_paths() -> list[Path]:
    """Files of this process whose background fsync has not finished."""
    with _lock:
        return [p.path for p in _pending]


def wait_pending(directory: str | os.PathLike[str] | None = None, *, block: bool = True) -> None:
    """Wait for this process's background fsyncs (of files in ``directory``, or all), then raise
    ``BackgroundSyncError`` for the first failed one not yet reported (every failure is raised
    once). ``block=False`` only raises failures already known."""
    where = None if directory is None else os.path.realpath(directory)
    if block:
        with _lock:
            waiting = [p for p in _pending if where is None or os.path.realpath(p.directory) == where]
        for pending in waiting:
            pending.done.wait()
    with _lock:
        if not _failed:
            return
        first = _failed.pop(0)
        others = len(_failed)
        _failed.clear()
    raise BackgroundSyncError(first.path, first.error or OSError("unknown"), others)


def _wait_at_exit() -> None:
    """At interpreter exit: wait for every background fsync; print failures not yet raised."""
    try:
        wait_pending()
    except BackgroundSyncError as e:
        more = f" ({e.others} more file(s) failed too)" if e.others else ""
        print(
            f"torchrepro: ERROR: {e.path} could not be written to disk durably (fsync failed: "
            f"{e.strerror}){more}. It was removed, so it cannot be found and used after a crash; "
            "save it again.",
            file=sys.stderr,
            flush=True,
        )


def _after_fork_in_child() -> None:
    """A forked child has no fsync threads: it starts with no pending syncs (the parent finishes
    and reports its own), and a fresh lock (the parent's may have been held by another thread)."""
    global _lock
    _lock = threading.Lock()
    _pending.clear()
    _failed.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
