"""Reading checkpoint files, which are untrusted: one open file, bounded memory, clear errors.

Invariants:
- A load reads one file: the path is opened once and everything (size checks, unpacking, mmap)
  reads that open file, so a save renaming a new file over the path meanwhile cannot mix two
  saves into one load.
- A file that declares more than ``max_expanded_bytes`` (default: twice its size plus 64 MiB) is
  refused before it is unpacked: its zip members' declared sizes, then, before any checksum, the
  copies of its non-contiguous tensor views.
- A path that is not a readable checkpoint file (a directory, a symlink loop, no read
  permission) is a ``CheckpointError`` naming the path and the cause; so is a file that is
  empty, truncated, not a torch zip file, not a torchrepro checkpoint, of a newer format version,
  malformed, or with a save clock that does not match its checksum.
- ``latest_checkpoint`` orders checkpoints by the save clock stored in each file, never by
  filesystem mtime, and skips (with a ``ReproWarning``) every file named like a checkpoint that
  cannot be read, is incomplete (a rank's file missing) or, with ``verify``, fails its checksums.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchrepro import _io
from torchrepro._runtime import process_group
from torchrepro.checkpoint import dcp
from torchrepro.checkpoint.format import (
    FORMAT_VERSION,
    KIND_WORDS,
    MARKER,
    RANK_FILE,
    _clock_digest,
    _verify,
    rank_path,
)
from torchrepro.checkpoint.writing import wait_pending
from torchrepro.errors import CheckpointError, ReproWarning, warn_once

__all__ = ["latest_checkpoint"]

_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt")
_ZIP_MAGIC = b"PK\x03\x04"


# Load with mmap: tensors are read once, from the page cache straight into the restored objects
# (plain torch.load reads them into new buffers first). Not on Windows, where a mapped file cannot
# be replaced by the next save.
MMAP = os.name != "nt"


# --------------------------------------------------------------------------- read and validate


_DEFAULT_EXPANSION_SLACK = 64 << 20


def _expansion_limit(file_size: int, max_expanded_bytes: int | None) -> int:
    """``max_expanded_bytes``, or by default twice the file's size plus 64 MiB: ``torch.save``
    stores its members uncompressed, so a checkpoint it wrote never declares more than its size."""
    if max_expanded_bytes is None:
        return 2 * file_size + _DEFAULT_EXPANSION_SLACK
    return max_expanded_bytes


def check_limit(max_expanded_bytes: Any) -> None:
    if max_expanded_bytes is None:
        return
    if isinstance(max_expanded_bytes, bool) or not isinstance(max_expanded_bytes, int):
        raise TypeError(
            f"max_expanded_bytes must be an int (bytes) or None (the default limit), got "
            f"{type(max_expanded_bytes).__name__} {max_expanded_bytes!r}."
        )
    if max_expanded_bytes < 0:
        raise ValueError(f"max_expanded_bytes must be >= 0, got {max_expanded_bytes}.")


def _read(
    path: Path, *, map_location: Any = "cpu", mmap: bool = False, max_expanded_bytes: int | None = None
) -> dict[str, Any]:
    """Load and structurally validate one checkpoint file; ``CheckpointError`` naming it if bad.

    Nothing is unpacked before the sizes the file declares are checked against the limit
    (``max_expanded_bytes``, see ``_expansion_limit``).
    """
    fd, size, head = _open_file(path)
    try:
        # Everything below reads this one open file, never the path again: a save that renames a
        # new file over the path meanwhile cannot mix two files' bytes into one load.
        source = _fd_path(fd)
        if size == 0:
            raise CheckpointError(f"Checkpoint {path} is empty (0 bytes): it was never written completely.")
        if head != _ZIP_MAGIC:
            raise CheckpointError(
                f"Checkpoint {path} is not a torch zip file (starts with {head!r}): it is corrupt, or not "
                "a checkpoint written by torchrepro.save_checkpoint."
            )
        limit = _expansion_limit(size, max_expanded_bytes)
        declared = _declared_bytes(path, fd, source)
        if declared > limit:
            what = f"before unpacking it: its zip members declare {declared:,} bytes"
            raise _too_large(path, size, declared, limit, what, max_expanded_bytes)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if source is not None:
                    payload = torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
                else:  # no path to this open file: read it whole (mmap needs a path)
                    with os.fdopen(os.dup(fd), "rb") as f:
                        f.seek(0)
                        payload = torch.load(f, map_location=map_location, weights_only=True)
        except Exception as e:
            detail = _describe_load_error(path, e)
            raise CheckpointError(f"Checkpoint {path} cannot be read: {detail}") from None
    finally:
        os.close(fd)
    _validate(payload, path)
    needed = declared + _copied_bytes(payload)
    if needed > limit:
        what = (
            f"before checksumming it: its members and the copies its non-contiguous tensor views "
            f"need take {needed:,} bytes"
        )
        raise _too_large(path, size, needed, limit, what, max_expanded_bytes)
    return payload  # type: ignore[no-any-return]


def _fd_path(fd: int) -> str | None:
    """A path that opens the file behind ``fd`` itself, whatever is renamed over its name
    (``/proc/self/fd/N`` on Linux), or ``None`` where there is none."""
    candidate = f"/proc/self/fd/{fd}"
    return candidate if os.path.exists(candidate) else None


def _open_file(path: Path) -> tuple[int, int, bytes]:
    """``(open fd, size, first 4 bytes)`` of the regular file at ``path`` (the caller closes the
    fd); ``CheckpointError`` naming it and the cause for anything else (missing, a directory or
    pipe, a symlink loop, no read permission). Opened non-blocking, so a named pipe in its place
    cannot hang the read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        if os.path.islink(path):
            raise CheckpointError(
                f"Checkpoint {path} is a symbolic link to a file that does not exist; point it at the "
                "checkpoint file or remove it."
            ) from None
        raise CheckpointError(f"No checkpoint file at {path}.") from None
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_a_file(path, info.st_mode)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return fd, info.st_size, os.pread(fd, 4, 0) if hasattr(os, "pread") else os.read(fd, 4)
    except OSError as e:
        os.close(fd)
        raise _unreadable(path, e) from None
    except BaseException:
        os.close(fd)
        raise


# errno -> (what happened, what to do) for a file that cannot be read.
_READ_FAILURES = {
    errno.EACCES: ("permission denied", "Make it readable for this user (chmod u+r) or load it as its owner"),
    errno.EPERM: ("permission denied", "Make it readable for this user (chmod u+r) or load it as its owner"),
    errno.ELOOP: (
        "it is a symbolic link loop (links that lead back to themselves)",
        "Point the link at the checkpoint file or remove it",
    ),
    errno.EIO: (
        "the storage reported an I/O error",
        "Copy it again from a backup, or resume from another checkpoint",
    ),
}


def _unreadable(path: Path, e: OSError) -> CheckpointError:
    return CheckpointError(f"Checkpoint {path} cannot be read: {_read_failure(e)}")


def _read_failure(e: OSError) -> str:
    what = e.strerror or str(e) or type(e).__name__
    fact, fix = _READ_FAILURES.get(e.errno or 0, (None, "Fix the cause, or resume from another checkpoint"))
    return f"{f'{fact} ({what})' if fact else what}. {fix}."


def _not_a_file(path: Path, mode: int) -> CheckpointError:
    if stat.S_ISDIR(mode):
        return CheckpointError(
            f"Checkpoint {path} is a directory, not a checkpoint file: save_checkpoint writes one file. "
            "To find the newest checkpoint inside a directory, call latest_checkpoint(directory)."
        )
    kind = (
        "a named pipe (FIFO)" if stat.S_ISFIFO(mode)
        else "a socket" if stat.S_ISSOCK(mode)
        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )  # fmt: skip
    return CheckpointError(
        f"Checkpoint {path} is {kind}, not a checkpoint file written by save_checkpoint; remove it or "
        "pass the path of the checkpoint file."
    )


_DAMAGED_ZIP = (
    "it is truncated or its zip structure is damaged (incomplete copy, full disk, or a "
    "writer that is not atomic). Delete it and resume from an earlier checkpoint."
)


def _declared_bytes(path: Path, fd: int, source: str | None) -> int:
    """The total uncompressed size the zip archive open as ``fd`` declares for its members (read
    from its central directory: nothing is unpacked). ``torch.load`` allocates what is declared."""
    try:
        with (
            open(source, "rb") if source is not None else os.fdopen(os.dup(fd), "rb") as f,
            zipfile.ZipFile(f) as archive,
        ):
            return sum(info.file_size for info in archive.infolist())
    except OSError as e:
        raise _unreadable(path, e) from None
    except Exception:  # BadZipFile, and whatever a crafted central directory raises
        raise CheckpointError(f"Checkpoint {path} cannot be read: {_DAMAGED_ZIP}") from None


def _copied_bytes(obj: Any) -> int:
    """Bytes the checksums copy to read ``obj``'s tensors: a strided tensor that is not contiguous
    is copied whole, and a view (an ``expand``) can declare far more elements than it stores."""
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided and not obj.is_contiguous():
            return obj.numel() * obj.element_size()
        return 0
    if isinstance(obj, dict):
        return sum(_copied_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_copied_bytes(v) for v in obj)
    return 0


def _too_large(
    path: Path, size: int, needed: int, limit: int, what: str, max_expanded_bytes: int | None
) -> CheckpointError:
    rule = (
        "the default: twice the file's size plus 64 MiB"
        if max_expanded_bytes is None
        else "max_expanded_bytes"
    )
    return CheckpointError(
        f"Checkpoint {path} was refused {what}, more than the limit of {limit:,} bytes ({rule}) for a "
        f"file of {size:,} bytes. A checkpoint save_checkpoint writes stays within it unless it holds "
        "expanded tensor views, so this one is likely damaged or crafted to exhaust memory. If you "
        f"trust it, pass max_expanded_bytes={needed} (or more) to load_checkpoint or latest_checkpoint."
    )


def _describe_load_error(path: Path, e: Exception) -> str:
    if isinstance(e, OSError) and e.errno in _READ_FAILURES:  # not EINVAL: torch's for a truncated file
        return _read_failure(e)
    text = str(e)
    if not zipfile.is_zipfile(path) or "central directory" in text or "zip archive" in text:
        return _DAMAGED_ZIP
    if "Weights only load failed" in text:
        return (
            "it contains pickled Python objects that torch.load(weights_only=True) refuses; "
            "torchrepro never writes those, so it was not written by torchrepro.save_checkpoint."
        )
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"it is corrupt ({type(e).__name__}: {first[:200]})."


def _validate(payload: Any, path: Path) -> None:
    if not isinstance(payload, dict) or MARKER not in payload:
        raise CheckpointError(
            f"{path} is a torch file but not a torchrepro checkpoint (no {MARKER!r} marker); "
            "was it written with plain torch.save? Load it with torch.load instead."
        )
    version = payload[MARKER]
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise CheckpointError(
            f"Checkpoint {path} has format version {version!r}; this torchrepro reads versions 1 to "
            f"{FORMAT_VERSION}. Upgrade torchrepro to read it."
        )
    meta, objects, rng = payload.get("meta"), payload.get("objects"), payload.get("rng")
    problems = []
    if not isinstance(meta, dict) or not all(
        isinstance(meta.get(k), int) for k in ("saved_at_ns", "sequence", "rank", "world_size")
    ):
        problems.append("'meta' is missing or incomplete")
    if not isinstance(objects, dict) or not all(_valid_entry(e) for e in objects.values()):
        problems.append("'objects' is missing or malformed")
    if (
        not isinstance(rng, dict)
        or not isinstance(rng.get("state"), dict)
        or not isinstance(rng.get("digest"), str)
    ):
        problems.append("'rng' is missing or malformed")
    if not isinstance(payload.get("env"), dict):
        problems.append("'env' is missing")
    if version >= 2 and isinstance(meta, dict) and not isinstance(meta.get("clock_digest"), str):
        problems.append("'meta' has no save clock checksum")
    if problems:
        raise CheckpointError(f"Checkpoint {path} is malformed: {'; '.join(problems)}.")
    meta = payload["meta"]  # a complete dict now
    if version >= 2 and meta["clock_digest"] != _clock_digest(meta["saved_at_ns"], meta["sequence"]):
        raise CheckpointError(
            f"Checkpoint {path} is corrupt: its save clock (saved_at_ns={meta['saved_at_ns']}, "
            f"sequence={meta['sequence']}) does not match its checksum, so it cannot be ordered against "
            "other checkpoints. Delete it and resume from another checkpoint."
        )


def _valid_entry(entry: Any) -> bool:
    grads = entry.get("grads", {}) if isinstance(entry, dict) else None
    return (
        isinstance(entry, dict)
        and entry.get("kind") in KIND_WORDS
        and isinstance(entry.get("digest"), str)
        and "state" in entry
        and isinstance(grads, dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in grads.items())
        and ("grads" not in entry or isinstance(entry.get("grads_digest"), str))
    )


# --------------------------------------------------------------------------- latest


def latest_checkpoint(
    directory: str | os.PathLike[str], *, verify: bool = True, max_expanded_bytes: int | None = None
) -> str | None:
    """The most recently saved complete checkpoint in ``directory``, or ``None`` if there is none
    (a directory that does not exist yet holds none: a first run resumes from nothing).

    "Most recent" is the save clock stored inside each file, not the filesystem mtime. Temporary
    files of writes in progress are ignored; files named like checkpoints (``.pt``, ``.pth``,
    ``.ckpt``, or any torch zip file) that are truncated, corrupt or incomplete (a rank's file
    missing) are skipped with a ``ReproWarning`` naming them. With ``verify`` (default) the chosen
    file's stored states are also checked against their checksums (one full read);
    ``verify=False`` checks structure only, and ``load_checkpoint`` still verifies.

    It first waits for this process's background fsyncs in ``directory`` (see ``save_checkpoint``),
    so it never returns a file that is not yet on disk, nor an older checkpoint than the one just
    saved; a background fsync that failed is raised as ``CheckpointWriteError``.

    Anything named like a checkpoint that is not a readable checkpoint file (a directory, a
    symlink loop, a file without read permission, one declaring more than ``max_expanded_bytes``
    once unpacked, see ``load_checkpoint``) is skipped with a ``ReproWarning`` too.
    """
    check_limit(max_expanded_bytes)
    root = Path(directory)
    if not root.is_dir():
        if not os.path.lexists(root):
            return None
        raise CheckpointError(
            f"Checkpoint directory {root} is not a directory; pass the directory the checkpoints "
            "are saved in."
        )
    # Never return a file that is not durable yet: wait for this process's fsyncs there rather
    # than skip their files (that would resume from an older checkpoint than the one just saved).
    wait_pending(root)
    try:
        files = sorted(root.iterdir())
    except OSError as e:
        raise CheckpointError(f"Checkpoint directory {root} cannot be listed: {_read_failure(e)}") from None
    rank, _ = process_group()
    headers: list[tuple[tuple[int, int, str], Path]] = []
    for file in files:
        if not _looks_like_checkpoint(file):
            continue
        try:
            payload = _read(file, mmap=True, max_expanded_bytes=max_expanded_bytes)
            _check_rank_files(file, payload, max_expanded_bytes)
        except CheckpointError as e:
            _skip(e)
            continue
        meta = payload["meta"]
        headers.append(((meta["saved_at_ns"], meta["sequence"], file.name), file))
    for _, file in sorted(headers, reverse=True):
        if verify:
            try:
                own = rank_path(file, rank)
                _verify(_read(own, mmap=True, max_expanded_bytes=max_expanded_bytes), own)
            except CheckpointError as e:
                _skip(e)
                continue
        return str(file)
    return None


def prune_checkpoints(directory: str | os.PathLike[str], keep: int) -> list[str]:
    """Remove all but the ``keep`` most recently saved checkpoints in ``directory``; return the
    paths removed, oldest first.

    "Most recently saved" is the save clock inside each file, as for ``latest_checkpoint``. Call
    it after ``save_checkpoint`` (on every rank under ``torch.distributed``: each rank removes
    its own files, rank 0 the main ones, rank ``r`` its ``.rank<r>`` files, ordered by their own
    clocks, so no rank needs a file another rank may be removing). Only files this process can
    read as torchrepro checkpoints are counted and removed: anything else in the directory (a
    corrupt or foreign file, a write in progress) is left alone. It first waits for this
    process's background fsyncs there, so the checkpoint just saved is on disk before an older
    one goes.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"prune_checkpoints(keep=...) must be an int >= 1 (checkpoints kept), got {keep!r}.")
    root = Path(directory)
    if not root.is_dir():
        return []
    wait_pending(root)
    rank, _ = process_group()
    suffix = f".rank{rank}"
    mine = []
    for file in sorted(root.iterdir()):
        if rank == 0 and not _looks_like_checkpoint(file):
            continue
        if rank > 0 and not (
            file.name.endswith(suffix) and _looks_like_checkpoint(file.with_name(file.name[: -len(suffix)]))
        ):
            continue
        try:
            meta = _read(file, mmap=True)["meta"]
        except CheckpointError:
            continue
        mine.append(((meta["saved_at_ns"], meta["sequence"], file.name), file))
    removed = []
    for _, file in sorted(mine)[: max(len(mine) - keep, 0)]:
        with contextlib.suppress(FileNotFoundError):
            file.unlink()
            removed.append(str(file))
    return removed


def _looks_like_checkpoint(file: Path) -> bool:
    """Named like a checkpoint (whatever it is: ``_read`` refuses, and the caller warns about, one
    that is not a readable file), or a regular file that starts like a torch zip file."""
    name = file.name
    if name.endswith(_io.TMP_SUFFIX) or RANK_FILE.search(name):
        return False
    if name.endswith(_CHECKPOINT_SUFFIXES):
        return True
    if not file.is_file():  # never open a named pipe: that would wait for a writer
        return False
    with contextlib.suppress(OSError), open(file, "rb") as f:
        return f.read(4) == _ZIP_MAGIC
    return False


def _check_rank_files(file: Path, payload: Mapping[str, Any], max_expanded_bytes: int | None) -> None:
    meta = payload["meta"]
    for name, entry in payload["objects"].items():  # sharded objects: their DCP directory
        directory = dcp.missing_directory(file, entry["state"]) if dcp.held(entry) else None
        if directory is not None:
            raise CheckpointError(
                f"Checkpoint {file} is incomplete: the sharded state of {name!r} in {directory.name} "
                "is missing or incomplete (no .metadata)."
            )
    for r in range(1, meta["world_size"]):
        if not rank_path(file, r).is_file():
            raise CheckpointError(
                f"Checkpoint {file} is incomplete: rank {r}'s file {rank_path(file, r).name} is missing."
            )
        other = _read(rank_path(file, r), mmap=True, max_expanded_bytes=max_expanded_bytes)
        if other["meta"]["sequence"] != meta["sequence"] or other["meta"]["world_size"] != meta["world_size"]:
            raise CheckpointError(
                f"Checkpoint {file} is incomplete: rank {r}'s file {rank_path(file, r).name} is from "
                "another save (different save sequence or world size)."
            )


def _skip(error: CheckpointError) -> None:
    warn_once(f"checkpoint-skip:{error}", f"Skipping checkpoint: {error}", ReproWarning, stacklevel=3)
