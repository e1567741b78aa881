"""Writing checkpoints: atomic files, durable now or in the background, failures named.

Invariants:
- A checkpoint is one ``torch.save`` file written atomically (temporary file in the same
  directory, then it appears at its path complete): a crash at any moment leaves the old file or
  the new one, never a torn one at a path that held a checkpoint. When ``save_checkpoint``
  returns, the complete file is at its path, so killing the process (SIGKILL, OOM, preemption)
  right after cannot lose it. By default (``durable="background"``) a save to a NEW path makes
  the file visible first and fsyncs it (and the directory) in a background thread: only a power
  loss in that moment can lose it, and a file torn that way fails its checksums, so
  ``latest_checkpoint`` skips it and ``load_checkpoint`` refuses it. A save over an existing file,
  and every save with ``durable="now"``, fsyncs before the rename, as plain atomic writes do.
- Every call that saves, and ``latest_checkpoint`` (for its directory), first waits for this
  process's pending background fsyncs, so it never returns a file this process saved that is
  not yet durable (other processes see such a file complete, not necessarily on disk);
  ``wait_for_checkpoints()`` and interpreter exit wait for all of them. A background fsync that
  fails removes its file from the path and is raised (``CheckpointWriteError``) by the next
  save, load, ``latest_checkpoint`` or ``wait_for_checkpoints`` call, or printed at exit.
- A write that fails (a full disk, a file-size limit) is a ``CheckpointWriteError`` naming the
  path and the cause; a failed write leaves no temporary file and the previous file intact.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import torch

from torchrepro import _io
from torchrepro._runtime import process_group
from torchrepro.checkpoint import dcp
from torchrepro.checkpoint.format import (
    FORMAT_VERSION,
    MARKER,
    RANK_FILE,
    _clock,
    _clock_digest,
    _digest,
    _environment,
    check_loadable,
    kind_of,
    pack,
    rank_path,
)
from torchrepro.errors import CheckpointError, CheckpointWriteError, ReproError

__all__ = ["save_checkpoint", "wait_for_checkpoints"]

_DURABLE = ("background", "now")


def save_checkpoint(path: str | os.PathLike[str], /, *, durable: str = "background", **objects: Any) -> str:
    """Save ``objects`` by name, plus the full RNG state and an environment record, atomically.

    Each object is saved by kind: modules, optimizers, LR schedulers, ``torch.amp.GradScaler``,
    ``SeededLoader`` and other objects with ``state_dict()``/``load_state_dict()`` through their
    ``state_dict()``; ``torch.Generator``/``numpy.random.Generator`` objects inside the RNG state;
    numbers, strings, bools, ``None``, tensors and dicts/lists of those as they are. Every
    object's state is saved with a checksum so ``load_checkpoint`` can verify the restore.
    A module's parameter gradients (``.grad``) are saved with it and restored (``None`` where
    there was none): a checkpoint taken between two ``backward()`` calls of a gradient
    accumulation window resumes exactly. (Saved after ``optimizer.step()``, gradients the next
    ``zero_grad()`` discards take space: call ``zero_grad()`` before saving to keep files small.)

    Under ``torch.distributed`` call it on every rank with the same ``path``: rank 0 writes
    ``path``, rank ``r`` writes ``path + ".rank<r>"``. Returns the path this process wrote.

    When it returns, the complete checkpoint is at the returned path: a process killed right
    after still leaves it there, complete and loadable. ``durable`` decides when it is also safe
    from a power loss (on disk, not only in the OS's cache):

    - ``"background"`` (default): a new file is fsynced (with its directory) in a background
      thread; the next save, ``latest_checkpoint`` of its directory, ``wait_for_checkpoints()``
      and interpreter exit wait for it. A file that already exists at ``path`` is replaced only
      after the new one is on disk, so a power loss never costs an earlier checkpoint; only the
      one being saved, which a torn write makes fail its checksums (never silently used).
    - ``"now"``: on disk before it returns (fsync, rename, fsync of the directory).

    ``durable`` is an option, so it cannot name a saved object.

    >>> import tempfile, torch, torchrepro
    >>> model = torch.nn.Linear(2, 1)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     path = torchrepro.save_checkpoint(f"{d}/step-10.pt", model=model, step=10)
    ...     torchrepro.latest_checkpoint(d) == path, torchrepro.load_checkpoint(path, model=model)
    (True, {'step': 10})
    """
    from torchrepro.rng import RngState

    if not isinstance(durable, str) or durable not in _DURABLE:
        raise ValueError(
            f"save_checkpoint(durable=...) is an option, 'background' (default) or 'now', got "
            f"{durable!r}; to save an object named 'durable', give it another name."
        )
    target = Path(path)
    if target.name.endswith(_io.TMP_SUFFIX) or RANK_FILE.search(target.name):
        raise ValueError(
            f"Checkpoint name {target.name!r} ends like a temporary or per-rank file "
            f"({_io.TMP_SUFFIX!r}, '.rank<N>'), which latest_checkpoint skips; choose another name."
        )
    if not objects:
        raise ValueError("save_checkpoint needs at least one object, e.g. save_checkpoint(path, model=model)")
    rank, world_size = process_group()

    entries: dict[str, dict[str, Any]] = {}
    generators: dict[str, Any] = {}
    sharded: dict[str, Any] = {}  # FSDP2 modules and their optimizers: through DCP
    for name, obj in objects.items():
        kind = kind_of(name, obj)
        if kind in ("module", "optimizer") and dcp.is_sharded(obj):
            sharded[name] = obj
            entries[name] = {"kind": kind, "sharded": True}  # its state: after the collective save
            continue
        if kind == "generator":
            generators[name] = obj
            entries[name] = {"kind": kind, "state": None, "digest": ""}
            continue
        state = obj if kind == "value" else obj.state_dict()
        check_loadable(state, name)
        entries[name] = {"kind": kind, "state": state, "digest": _digest(state, name)}
        if kind == "module":  # gradients are state: a save inside an accumulation window needs them
            grads = _gradients(obj)
            entries[name].update(grads=grads, grads_digest=_digest(grads, name))

    if sharded:
        for name, state in dcp.save(target, sharded, rank).items():
            entries[name].update(state=state, digest=_digest(state, name))
    try:
        rng = pack(RngState.capture(generators=generators).to_dict())
    except ReproError as e:
        raise CheckpointError(f"Cannot save {target}: the RNG state cannot be captured: {e}") from None
    check_loadable(rng, "RNG state")
    saved_at_ns, sequence = _clock.tick()
    payload = {
        MARKER: FORMAT_VERSION,
        "meta": {
            "saved_at_ns": saved_at_ns,
            "sequence": sequence,
            "clock_digest": _clock_digest(saved_at_ns, sequence),
            "rank": rank,
            "world_size": world_size,
            "names": list(entries),
        },
        "env": _environment(rank, world_size),
        "objects": entries,
        "rng": {"state": rng, "digest": _digest(rng, "RNG state")},
    }
    check_loadable(payload["env"], "environment record")
    out = rank_path(target, rank)
    wait_pending()  # one background fsync at a time; an earlier save's failure is raised here
    existed = out.is_file()
    try:
        with _io.atomic_open(out, "wb", background=durable == "background") as f:
            torch.save(payload, f)
    except Exception as e:
        cause = _os_error_in(e)
        if cause is None:
            raise
        raise _write_error(out, cause, existed) from None
    _clock.observe(saved_at_ns, sequence)
    return str(out)


def _gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The ``.grad`` of each of ``module``'s parameters that has one, by parameter name."""
    return {name: p.grad for name, p in module.named_parameters() if p.grad is not None}


def wait_for_checkpoints() -> None:
    """Wait until every checkpoint this process saved is on disk (fsynced, with its directory).

    Raises ``CheckpointWriteError`` naming the file if a background fsync failed (the file was
    removed from its path: save it again). ``save_checkpoint(..., durable="now")`` waits for its
    own file; interpreter exit waits for all.
    """
    wait_pending()


def wait_pending(directory: Path | None = None, *, block: bool = True) -> None:
    try:
        _io.wait_pending(directory, block=block)
    except _io.BackgroundSyncError as e:
        more = f" ({e.others} more checkpoint file(s) failed the same way)" if e.others else ""
        fact, fix = _WRITE_FAILURES.get(e.errno or 0, (None, "Fix the cause and save it again"))
        error = CheckpointWriteError(
            f"Cannot write checkpoint {e.path} to disk: the background fsync after save_checkpoint "
            f"returned failed: {f'{fact} ({e.strerror})' if fact else e.strerror}{more}. The file was "
            f"removed, so nothing can resume from a copy that may not be on disk. {fix}; earlier "
            "checkpoints are intact."
        )
        error.errno = e.errno
        raise error from None


def _os_error_in(error: BaseException) -> OSError | None:
    """The ``OSError`` behind ``error``: itself, or one in its cause/context chain (``torch.save``
    turns a failed write into ``RuntimeError: [enforce fail at inline_container.cc] unexpected
    pos``, raised while the write's ``OSError`` is being handled)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


# errno -> (what happened, what to do) for a write that failed.
_WRITE_FAILURES = {
    errno.ENOSPC: ("the disk is full", "Free space on it (or save to another disk) and save again"),
    getattr(errno, "EDQUOT", -1): (
        "the disk quota is used up",
        "Free space or raise the quota, and save again",
    ),
    errno.EFBIG: (
        "the file would be larger than this process may write (ulimit -f, RLIMIT_FSIZE) or the "
        "filesystem allows",
        "Raise the limit (ulimit -f unlimited) or save to another filesystem",
    ),
    errno.EACCES: ("permission denied", "Make the directory writable for this user, or save elsewhere"),
    errno.EPERM: ("permission denied", "Make the directory writable for this user, or save elsewhere"),
    errno.EROFS: ("the filesystem is read-only", "Save to a writable directory"),
    errno.EEXIST: (  # from creating its directory
        "a part of its directory path is a file, not a directory",
        "Move that file away or save elsewhere",
    ),
    errno.ENOTDIR: (
        "a part of its directory path is a file, not a directory",
        "Move that file away or save elsewhere",
    ),
}


def _write_error(out: Path, cause: OSError, existed: bool) -> CheckpointWriteError:
    what = cause.strerror or str(cause) or type(cause).__name__
    if cause.filename is not None and not str(cause.filename).endswith(_io.TMP_SUFFIX):
        what += f": {cause.filename}"  # the directory it could not create or write in
    fact, fix = _WRITE_FAILURES.get(cause.errno or 0, (None, "Fix the cause and save again"))
    kept = "the previous checkpoint there is intact" if existed else "nothing was written there"
    error = CheckpointWriteError(
        f"Cannot write checkpoint {out}: {f'{fact} ({what})' if fact else what}. {fix}; {kept} and "
        "no temporary file is left."
    )
    error.errno = cause.errno  # still an OSError a caller can test for errno.ENOSPC
    return error
