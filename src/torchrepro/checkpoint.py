"""Checkpoints that bring back every bit: model, optimizer, scheduler, scaler, data position, RNG.

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
- A checkpoint loads with ``torch.load(weights_only=True)``: only tensors, numbers, strings and
  containers of them; anything else is refused when SAVING, naming the object and the key.
- Every object's state is saved with a checksum (structure, dtypes, shapes, CRC32 of the tensor
  bytes: memory speed); ``load_checkpoint`` checksums the restored state again and raises
  ``CheckpointError`` naming the object when they differ (corrupt bytes, partial loads, dtype
  narrowing).
- The full ``RngState`` is always saved and is restored LAST, after every object (loaders
  included) is set up, so nothing consumes random numbers between the restore and training.
- Under ``torch.distributed`` every rank calls ``save_checkpoint`` with the same ``path``;
  rank 0 writes ``path`` and rank ``r > 0`` writes ``path + ".rank<r>"`` (its own objects and
  RNG state). No collective is used, so a rank that does not save cannot hang the others; a
  missing rank file or a different world size is a clear ``CheckpointError`` at load time.
- ``latest_checkpoint`` orders checkpoints by the save clock stored in each file (a wall-clock
  time kept monotonic across saves and resumes), never by filesystem mtime. The clock has its own
  checksum (format version 2), so a damaged clock is refused instead of reordering checkpoints.
- A path that is not a readable checkpoint file (a directory, a symlink loop, no read
  permission) and a write that fails (a full disk, a file-size limit) are ``CheckpointError``s
  naming the path and the cause; a failed write leaves no temporary file and the previous file
  intact.
- A file that declares more than ``max_expanded_bytes`` (default: twice its size plus 64 MiB) is
  refused before it is unpacked: its zip members' declared sizes, then, before any checksum, the
  copies of its non-contiguous tensor views.
- A load reads one file: the path is opened once and everything (size checks, unpacking, mmap)
  reads that open file, so a save renaming a new file over the path meanwhile cannot mix two
  saves into one load.
- ``load_checkpoint`` checks what it can cheaply before it copies anything into the objects
  passed (names, kinds, a module's keys, shapes and dtypes, an optimizer's parameter groups, the
  RNG state), so a load refused by those checks changes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import platform
import re
import stat
import sys
import time
import warnings
import zipfile
import zlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchrepro import _io, hashing
from torchrepro._runtime import process_group
from torchrepro.errors import CheckpointError, CheckpointWriteError, ReproError, ReproWarning, warn_once
from torchrepro.flags import DeterminismFlags
from torchrepro.hashing import fingerprint

if TYPE_CHECKING:
    from torchrepro.rng import RngState

__all__ = [
    "FORMAT_VERSION",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "wait_for_checkpoints",
]

FORMAT_VERSION = 2
"""Version of the checkpoint layout; files with a newer version are refused with a clear error.

Version 2 adds ``meta["clock_digest"]``, the checksum of the save clock; version 1 files (without
it) are still read."""

_MARKER = "torchrepro_checkpoint"
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt")
_ZIP_MAGIC = b"PK\x03\x04"
_RANK_FILE = re.compile(r"\.rank(\d+)$")
# Load with mmap: tensors are read once, from the page cache straight into the restored objects
# (plain torch.load reads them into new buffers first). Not on Windows, where a mapped file cannot
# be replaced by the next save.
_MMAP = os.name != "nt"

# Kinds, in the order load_checkpoint restores them (RNG comes after all of them).
_RESTORE_ORDER = ("module", "optimizer", "scheduler", "grad_scaler", "stateful", "loader", "generator")
# Kinds whose stored state is verified against its checksum instead of the restored one: plain
# values are not restored into anything, and a loader normalises its position on load (a finished
# epoch becomes the start of the next one), so its restored state_dict may differ legitimately.
_VERIFIED_AS_STORED = ("value", "loader")
_KIND_WORDS = {
    "module": "a module (torch.nn.Module)",
    "optimizer": "an optimizer (torch.optim.Optimizer)",
    "scheduler": "an LR scheduler",
    "grad_scaler": "a GradScaler (torch.amp.GradScaler)",
    "stateful": "an object with state_dict()/load_state_dict()",
    "loader": "a data loader (torchrepro.SeededLoader)",
    "generator": "an RNG generator (torch.Generator, numpy.random.Generator or RandomState)",
    "value": "a plain value",
}


# --------------------------------------------------------------------------- save clock


@dataclass
class _Clock:
    """Last save clock seen by this process (saved or loaded), so later saves order after it."""

    saved_at_ns: int = 0
    sequence: int = 0

    def tick(self) -> tuple[int, int]:
        saved_at = max(time.time_ns(), self.saved_at_ns + 1)
        return saved_at, self.sequence + 1

    def observe(self, saved_at_ns: int, sequence: int) -> None:
        self.saved_at_ns = max(self.saved_at_ns, saved_at_ns)
        self.sequence = max(self.sequence, sequence)


_clock = _Clock()


def _clock_digest(saved_at_ns: int, sequence: int) -> str:
    """The checksum of a save clock (``meta["clock_digest"]``, format version 2)."""
    text = f"{saved_at_ns},{sequence}".encode()
    return hashlib.blake2b(text, digest_size=16, person=b"trepro-clock-v2").hexdigest()


# --------------------------------------------------------------------------- kinds


def _is_numpy_generator(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, (np.random.Generator, np.random.RandomState))


def _kind_of(name: str, obj: Any) -> str:
    """The kind an object is saved as; ``TypeError`` naming ``name`` for anything unsupported."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (LRScheduler, ReduceLROnPlateau)):
        return "scheduler"
    if isinstance(obj, torch.amp.GradScaler):
        return "grad_scaler"
    if isinstance(obj, torch.Generator) or _is_numpy_generator(obj):
        return "generator"
    stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
    if isinstance(obj, torch.utils.data.DataLoader):
        if stateful:
            return "loader"
        raise TypeError(
            f"Cannot checkpoint {name!r}: a plain torch DataLoader has no resumable position. "
            "Use torchrepro.SeededLoader(dataset, batch_size=..., seed=...) so a resume neither "
            "replays nor skips batches."
        )
    if stateful:
        return "stateful"
    if _is_plain_value(obj):
        return "value"
    raise TypeError(
        f"Cannot checkpoint {name!r} of type {type(obj).__module__}.{type(obj).__qualname__}: pass a "
        "module, optimizer, LR scheduler, GradScaler, SeededLoader, torch/numpy Generator, an object "
        "with state_dict()/load_state_dict(), or a plain value (number, string, bool, None, tensor, "
        "or dicts/lists of those)."
    )


def _is_plain_value(obj: Any) -> bool:
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return True
    if type(obj) in (list, tuple):
        return all(_is_plain_value(v) for v in obj)
    if type(obj) in (dict, OrderedDict):
        return all(isinstance(k, str) and _is_plain_value(v) for k, v in obj.items())
    return False


# --------------------------------------------------------------------------- weights_only check

_SCALARS: tuple[type, ...] = (bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)
_MAPPINGS: tuple[type, ...] = (dict, OrderedDict, Counter)
_SEQUENCES: tuple[type, ...] = (list, tuple, set, torch.Size)
_FLAT: tuple[type, ...] = (bool, int, float, str, type(None))


def _check_loadable(obj: Any, name: str, key: str = "") -> None:
    """Raise ``CheckpointError`` if ``torch.load(weights_only=True)`` would refuse ``obj``."""
    if obj is None or type(obj) in _SCALARS:
        return
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            _refuse(obj, name, key, "a tensor subclass")
        return
    if type(obj) in _MAPPINGS:
        for k, v in obj.items():
            _check_loadable(k, name, f"{key}[{k!r}] (the key)")
            _check_loadable(v, name, f"{key}[{k!r}]")
        return
    if type(obj) in _SEQUENCES:
        if all(type(v) in _FLAT for v in obj):
            return
        for i, v in enumerate(obj):
            _check_loadable(v, name, f"{key}[{i}]")
        return
    _refuse(obj, name, key, "an arbitrary Python object")


def _refuse(obj: Any, name: str, key: str, what: str) -> None:
    where = f"at {key}" if key else "itself"
    raise CheckpointError(
        f"Cannot checkpoint {name!r}: its state {where} is {what} of type "
        f"{type(obj).__module__}.{type(obj).__qualname__}, which torch.load(weights_only=True) refuses. "
        "Checkpoints hold only tensors, numbers, strings and containers of them; convert that "
        "entry (e.g. to a tensor, a number or a string) in the object's state_dict()."
    )


# --------------------------------------------------------------------------- environment


def _determinism_switches() -> dict[str, Any]:
    flags = DeterminismFlags.capture()
    return {
        "deterministic_algorithms": flags.deterministic_algorithms,
        "deterministic_warn_only": flags.warn_only,
        "cudnn.deterministic": flags.cudnn_deterministic,
        "cudnn.benchmark": flags.cudnn_benchmark,
        "cudnn.allow_tf32": flags.cudnn_allow_tf32,
        "cuda.matmul.allow_tf32": flags.cuda_matmul_allow_tf32,
        "float32_matmul_precision": flags.float32_matmul_precision,
        "mkldnn.enabled": bool(torch.backends.mkldnn.enabled),
    }


def _environment(rank: int, world_size: int) -> dict[str, Any]:
    """A small record of what decides the bits: versions, devices, switches, threads, ranks."""
    cuda_devices = []
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        cuda_devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "torch": str(torch.__version__),  # TorchVersion is a str subclass weights_only refuses
        "python": platform.python_version(),
        "platform": sys.platform,
        "cuda": torch.version.cuda or "",
        "cuda_devices": cuda_devices,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "num_threads": torch.get_num_threads(),
        "determinism": _determinism_switches(),
        "rank": rank,
        "world_size": world_size,
    }


# Keys compared on load; rank/world size are checked separately (a mismatch is an error).
_ENV_COMPARED = ("torch", "python", "cuda", "cuda_devices", "cpu_capability", "num_threads", "determinism")


def _env_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    diffs = []
    for key in _ENV_COMPARED:
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [
                f"{key}.{k}: saved {a.get(k)!r}, now {b.get(k)!r}" for k in sorted(a) if a.get(k) != b.get(k)
            ]
        elif a != b:
            diffs.append(f"{key}: saved {a!r}, now {b!r}")
    return diffs


# --------------------------------------------------------------------------- paths


def _rank_path(path: Path, rank: int) -> Path:
    return path if rank == 0 else path.with_name(f"{path.name}.rank{rank}")


# --------------------------------------------------------------------------- save


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
    if target.name.endswith(_io.TMP_SUFFIX) or _RANK_FILE.search(target.name):
        raise ValueError(
            f"Checkpoint name {target.name!r} ends like a temporary or per-rank file "
            f"({_io.TMP_SUFFIX!r}, '.rank<N>'), which latest_checkpoint skips; choose another name."
        )
    if not objects:
        raise ValueError("save_checkpoint needs at least one object, e.g. save_checkpoint(path, model=model)")
    rank, world_size = process_group()

    entries: dict[str, dict[str, Any]] = {}
    generators: dict[str, Any] = {}
    for name, obj in objects.items():
        kind = _kind_of(name, obj)
        if kind == "generator":
            generators[name] = obj
            entries[name] = {"kind": kind, "state": None, "digest": ""}
            continue
        state = obj if kind == "value" else obj.state_dict()
        _check_loadable(state, name)
        entries[name] = {"kind": kind, "state": state, "digest": _digest(state, name)}
        if kind == "module":  # gradients are state: a save inside an accumulation window needs them
            grads = _gradients(obj)
            entries[name].update(grads=grads, grads_digest=_digest(grads, name))

    try:
        rng = _pack(RngState.capture(generators=generators).to_dict())
    except ReproError as e:
        raise CheckpointError(f"Cannot save {target}: the RNG state cannot be captured: {e}") from None
    _check_loadable(rng, "RNG state")
    saved_at_ns, sequence = _clock.tick()
    payload = {
        _MARKER: FORMAT_VERSION,
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
    _check_loadable(payload["env"], "environment record")
    out = _rank_path(target, rank)
    _wait_pending()  # one background fsync at a time; an earlier save's failure is raised here
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


def wait_for_checkpoints() -> None:
    """Wait until every checkpoint this process saved is on disk (fsynced, with its directory).

    Raises ``CheckpointWriteError`` naming the file if a background fsync failed (the file was
    removed from its path: save it again). ``save_checkpoint(..., durable="now")`` waits for its
    own file; interpreter exit waits for all.
    """
    _wait_pending()


def _wait_pending(directory: Path | None = None, *, block: bool = True) -> None:
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


_PACKED = "__torchrepro_int64_list__"
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _pack(obj: Any) -> Any:
    """Long lists of ints (Python's and NumPy's RNG state words) as one int64 tensor each:
    ``torch.load(weights_only=True)`` unpickles a tensor much faster than 625 separate ints."""
    if type(obj) is dict:
        return {k: _pack(v) for k, v in obj.items()}
    if (
        type(obj) is list
        and len(obj) >= 64
        and all(type(v) is int and _INT64[0] <= v <= _INT64[1] for v in obj)
    ):
        return {_PACKED: torch.tensor(obj, dtype=torch.int64)}
    if type(obj) is list:
        return [_pack(v) for v in obj]
    return obj


def _unpack(obj: Any) -> Any:
    if type(obj) is dict:
        packed = obj.get(_PACKED)
        if len(obj) == 1 and isinstance(packed, torch.Tensor):
            return packed.tolist()
        return {k: _unpack(v) for k, v in obj.items()}
    if type(obj) is list:
        return [_unpack(v) for v in obj]
    return obj


_PIECE_BYTES = 1 << 22  # tensors are checksummed in 4 MiB pieces, in parallel threads
_PARALLEL_BYTES = 1 << 24  # below this much tensor data, one thread is quicker


def _digest(state: Any, name: str) -> str:
    """A checksum of ``state``'s value: BLAKE2b over its structure, plain values, tensor dtypes
    and shapes, and the CRC32 of every 4 MiB piece of each dense tensor's bytes (the same on
    every device; sparse and quantized tensors contribute their ``fingerprint``).

    CRC32 runs at memory speed (~10x ``fingerprint`` on CPU) and releases the GIL, so pieces
    are checksummed in parallel threads; this keeps saving and verifying close to plain
    ``torch.save``/``torch.load``. It detects every burst error up to 32 bits and any other
    corruption with probability 1 - 2**-32 per piece; the dtype/shape header catches narrowing.
    Dict entries are taken in sorted key order.
    """
    parts: list[bytes | memoryview] = []
    keep: list[torch.Tensor] = []  # contiguous host copies the memoryviews point into
    try:
        _feed(parts, keep, state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"Cannot checksum the state of {name!r} for verification: {e}") from None
    pieces = [p for p in parts if isinstance(p, memoryview)]
    if sum(p.nbytes for p in pieces) >= _PARALLEL_BYTES:
        crcs = iter(hashing.parallel_map(zlib.crc32, pieces))
    else:
        crcs = iter([zlib.crc32(p) for p in pieces])
    h = hashlib.blake2b(digest_size=16, person=b"trepro-ckpt-v1")
    for part in parts:
        h.update(next(crcs).to_bytes(4, "little") if isinstance(part, memoryview) else part)
    return h.hexdigest()


def _feed(parts: list[bytes | memoryview], keep: list[torch.Tensor], obj: Any) -> None:
    kind = type(obj)
    if isinstance(obj, torch.Tensor):
        _feed_tensor(parts, keep, obj)
    elif kind in _MAPPINGS:
        items = sorted(obj.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        parts.append(b"{%d:" % len(items))
        for key, value in items:
            _feed(parts, keep, key)
            _feed(parts, keep, value)
    elif kind in _SEQUENCES and kind is not set:
        if all(type(v) in _FLAT for v in obj):  # repr tells 1, 1.0, True and '1' apart
            parts.append(f"{kind.__name__}{list(obj)!r}".encode())
            return
        parts.append(f"[{kind.__name__}{len(obj)}:".encode())
        for value in obj:
            _feed(parts, keep, value)
    elif kind is set:
        parts.append(f"set{sorted(repr(v) for v in obj)}".encode())
    else:
        parts.append(f"({kind.__name__}){obj!r};".encode())


def _feed_tensor(parts: list[bytes | memoryview], keep: list[torch.Tensor], t: torch.Tensor) -> None:
    parts.append(f"<tensor {t.dtype} {tuple(t.shape)}>".encode())
    if t.layout != torch.strided or t.is_quantized:  # rare in checkpoints: the full fingerprint
        parts.append(fingerprint(t).encode())
        return
    if t.device.type == "meta":
        return
    # Same checksum on every device, so a state saved from CPU verifies when restored to CUDA.
    c = t.detach()
    if c.device.type != "cpu":
        c = c.cpu()
    c = c.resolve_conj().resolve_neg().contiguous()
    if c.numel():
        keep.append(c)
        parts.extend(hashing.chunks(hashing.byte_view(c), _PIECE_BYTES))


# --------------------------------------------------------------------------- read and validate


_DEFAULT_EXPANSION_SLACK = 64 << 20


def _expansion_limit(file_size: int, max_expanded_bytes: int | None) -> int:
    """``max_expanded_bytes``, or by default twice the file's size plus 64 MiB: ``torch.save``
    stores its members uncompressed, so a checkpoint it wrote never declares more than its size."""
    if max_expanded_bytes is None:
        return 2 * file_size + _DEFAULT_EXPANSION_SLACK
    return max_expanded_bytes


def _check_limit(max_expanded_bytes: Any) -> None:
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
    if not isinstance(payload, dict) or _MARKER not in payload:
        raise CheckpointError(
            f"{path} is a torch file but not a torchrepro checkpoint (no {_MARKER!r} marker); "
            "was it written with plain torch.save? Load it with torch.load instead."
        )
    version = payload[_MARKER]
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
        and entry.get("kind") in _KIND_WORDS
        and isinstance(entry.get("digest"), str)
        and "state" in entry
        and isinstance(grads, dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in grads.items())
        and ("grads" not in entry or isinstance(entry.get("grads_digest"), str))
    )


def _gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The ``.grad`` of each of ``module``'s parameters that has one, by parameter name."""
    return {name: p.grad for name, p in module.named_parameters() if p.grad is not None}


def _grad_mismatches(module: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> list[str]:
    params = dict(module.named_parameters())
    problems = [f"a gradient for {k!r}, a parameter the module lacks" for k in grads if k not in params]
    problems += [
        f"the gradient of {k!r} has shape {tuple(g.shape)}, the parameter {tuple(params[k].shape)}"
        for k, g in grads.items()
        if k in params and g.shape != params[k].shape and not torch.nn.parameter.is_lazy(params[k])
    ]
    return problems


def _restore_gradients(module: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Give every parameter its saved ``.grad`` (``None`` when none was saved), copying into an
    existing gradient tensor when it fits (DDP's bucket views stay attached)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            saved = grads.get(name)
            if saved is None:
                p.grad = None
            elif p.grad is not None and p.grad.shape == saved.shape and p.grad.dtype == saved.dtype:
                p.grad.copy_(saved)
            else:
                p.grad = saved.to(device=p.device, dtype=p.dtype, copy=True)


def _verify(payload: Mapping[str, Any], path: Path, names: Iterable[str] | None = None) -> None:
    """Check the stored states against their stored checksums (detects corrupt bytes)."""
    objects = payload["objects"]
    for name in objects if names is None else names:
        entry = objects[name]
        if entry["kind"] != "generator" and _digest(entry["state"], name) != entry["digest"]:
            raise CheckpointError(
                f"Checkpoint {path} is corrupt: the stored state of {name!r} does not match its "
                "checksum. Resume from an earlier checkpoint."
            )
        if "grads" in entry and _digest(entry["grads"], name) != entry["grads_digest"]:
            raise CheckpointError(
                f"Checkpoint {path} is corrupt: the stored gradients of {name!r} do not match their "
                "checksum. Resume from an earlier checkpoint."
            )
    if _digest(payload["rng"]["state"], "RNG state") != payload["rng"]["digest"]:
        raise CheckpointError(
            f"Checkpoint {path} is corrupt: the stored RNG state does not match its checksum. "
            "Resume from an earlier checkpoint."
        )


# --------------------------------------------------------------------------- load


def load_checkpoint(
    path: str | os.PathLike[str],
    /,
    *,
    map_location: Any = "cpu",
    restore_rng: bool = True,
    verify: bool = True,
    max_expanded_bytes: int | None = None,
    **objects: Any,
) -> dict[str, Any]:
    """Restore the named ``objects`` in place from ``path``, the RNG state last; return plain values.

    Objects are restored in the order modules, optimizers, schedulers, scalers, other stateful
    objects, loaders, generators; then the global RNG state (Python, NumPy, torch CPU, every
    initialised CUDA device) is restored, so the next random draw is the one the saved run made.
    Returns every plain value in the file (e.g. ``{"step": 30}``). With ``verify`` (default)
    each restored object's state is checksummed and compared with the saved checksum
    (loaders, plain values and the RNG state are checked as stored, before anything is restored:
    a loader's position is normalised on load, a finished epoch becoming the next one).
    ``restore_rng=False`` leaves the global RNG as it is (not an exact resume).

    Before anything is copied into the objects, what can be checked cheaply is: names and kinds,
    each module's keys, shapes and (with ``verify``) dtypes, each optimizer's parameter groups,
    the RNG state and generators, the checksums of plain values and loaders. A load refused by
    those checks leaves every object as it was. Found only after the copy: an object's own
    ``load_state_dict`` refusing the state (e.g. a loader built with another batch size), and a
    restored state that does not match its checksum (corrupt tensor bytes, lossy restores); a
    second checksum pass before the copy would slow every load, and ``latest_checkpoint``
    already checks the stored states.

    ``max_expanded_bytes`` caps what reading the file may unpack (the zip members' declared
    sizes, plus copies of non-contiguous tensor views for the checksums); a file declaring more
    is refused before it is unpacked. The default, ``None``, is twice the file's size plus
    64 MiB, which every file ``torch.save`` writes stays within.

    Raises ``CheckpointError`` naming the file and object: unknown names (listing the ones
    present), kind mismatches, corrupt or truncated files, paths that are not readable files,
    restores that do not reproduce the saved state, a different world size. Warns
    (``ReproWarning``) when the checkpoint was saved in a different environment (torch version,
    devices, determinism switches, threads).
    """
    from torchrepro.rng import RngState

    _check_limit(max_expanded_bytes)
    # A file still being fsynced is complete at its path: reading it needs no wait. A background
    # fsync that already failed is raised here.
    _wait_pending(block=False)
    base = Path(path)
    rank, world_size = process_group()
    file = _rank_path(base, rank)
    if rank > 0 and not file.exists() and base.exists():
        raise CheckpointError(
            f"Rank {rank} has no checkpoint file {file} beside {base}: every rank must call "
            "save_checkpoint(path, ...) with the same path (each saves its own RNG state)."
        )
    payload = _read(file, map_location=map_location, mmap=_MMAP, max_expanded_bytes=max_expanded_bytes)
    meta, entries = payload["meta"], payload["objects"]
    if meta["world_size"] != world_size:
        raise CheckpointError(
            f"Checkpoint {file} was saved by a run with world size {meta['world_size']}; this run has "
            f"world size {world_size}. Each rank's RNG state is saved per rank, so resume with the same "
            f"number of processes (e.g. torchrun --nproc-per-node {meta['world_size']})."
        )

    for name, obj in objects.items():
        if name not in entries:
            held = ", ".join(sorted(entries)) or "nothing"
            raise CheckpointError(f"Checkpoint {file} has no object {name!r}; it holds: {held}.")
        kind, saved_kind = _kind_of(name, obj), entries[name]["kind"]
        if kind == "value":
            raise TypeError(
                f"{name!r} is a plain value: load_checkpoint returns plain values "
                f"(result[{name!r}]) instead of restoring them in place; do not pass it."
            )
        if kind != saved_kind:
            raise CheckpointError(
                f"Checkpoint {file} holds {_KIND_WORDS[saved_kind]} under {name!r}, but "
                f"{_KIND_WORDS[kind]} ({type(obj).__qualname__}) was given to restore into."
            )
    generators = {n: o for n, o in objects.items() if entries[n]["kind"] == "generator"}
    if generators and not restore_rng:
        raise ValueError(
            f"Generators {sorted(generators)} are restored with the RNG state; drop restore_rng=False."
        )

    diffs = _env_differences(payload["env"], _environment(rank, world_size))
    if diffs:
        warn_once(
            "checkpoint-env:" + "|".join(diffs),
            f"Checkpoint {file} was saved in a different environment, so the resumed run may not "
            f"match the original bit for bit: {'; '.join(diffs)}.",
            ReproWarning,
            stacklevel=2,
        )

    ordered = sorted(objects, key=lambda n: _RESTORE_ORDER.index(entries[n]["kind"]))
    # What can be checked cheaply is checked before the first object changes.
    if verify:  # checked as stored: plain values, loaders, the RNG state
        _verify(payload, file, [n for n, e in entries.items() if e["kind"] in _VERIFIED_AS_STORED])
    rng_state = None
    if restore_rng:
        try:
            rng_state = RngState.from_dict(_unpack(payload["rng"]["state"]))
            _check_rng_targets(rng_state, generators)
        except ReproError as e:
            raise CheckpointError(f"Cannot restore the RNG state saved in {file}: {e}") from None
    for name in ordered:
        if entries[name]["kind"] not in _VERIFIED_AS_STORED and entries[name]["kind"] != "generator":
            _check_before_restore(file, name, objects[name], entries[name]["state"], verify=verify)
        grads = entries[name].get("grads")
        if grads is not None:
            if verify and _digest(grads, name) != entries[name]["grads_digest"]:
                raise CheckpointError(
                    f"Checkpoint {file} is corrupt: the stored gradients of {name!r} do not match "
                    "their checksum. Nothing was changed; resume from an earlier checkpoint."
                )
            problems = _grad_mismatches(objects[name], grads)
            if problems:
                raise CheckpointError(
                    f"Cannot restore the gradients of {name!r} from {file}: the checkpoint holds "
                    f"{_some(problems, quote=False)}. Nothing was changed; restore into a module built "
                    "like the one that was saved."
                )
    for name in ordered:
        if entries[name]["kind"] != "generator":
            _restore_one(file, name, objects[name], entries[name]["state"])
            if "grads" in entries[name]:
                _restore_gradients(objects[name], entries[name]["grads"])
    if verify:
        for name in ordered:
            entry = entries[name]
            if entry["kind"] in _VERIFIED_AS_STORED or entry["kind"] == "generator":
                continue
            if _digest(objects[name].state_dict(), name) != entry["digest"]:
                raise CheckpointError(
                    f"Restoring {name!r} from {file} did not reproduce the saved state (its checksum "
                    "differs): the file is corrupt, or the object cannot hold the saved values exactly "
                    "(different dtype, fewer entries, a load_state_dict that drops or converts "
                    "values). Restore into an object built like the one that was saved."
                )
    if rng_state is not None:
        try:
            rng_state.restore(generators=generators)
        except ReproError as e:  # pragma: no cover - its checks ran above, before any restore
            raise CheckpointError(f"Cannot restore the RNG state saved in {file}: {e}") from None
    _clock.observe(meta["saved_at_ns"], meta["sequence"])
    return {n: e["state"] for n, e in entries.items() if e["kind"] == "value"}


def _check_rng_targets(state: RngState, generators: Mapping[str, Any]) -> None:
    """What ``RngState.restore`` checks before it changes anything (each generator's kind and
    device, the CUDA device count), run before the first object is restored."""
    from torchrepro import rng

    for name, gen in generators.items():
        state._check_target(name, gen)
    rng._check_device_count(state.cuda)


def _check_before_restore(file: Path, name: str, obj: Any, state: Any, *, verify: bool) -> None:
    """Refuse, before anything is copied, a restore that cannot reproduce the saved ``state``: what
    a module's or optimizer's ``load_state_dict`` would refuse only after copying part of it, and
    (with ``verify``) a module dtype that the checksum after the copy would refuse."""
    if isinstance(obj, torch.nn.Module):
        problems, dtypes = _module_mismatches(obj, state, dtypes=verify)
    elif isinstance(obj, torch.optim.Optimizer):
        problems, dtypes = _optimizer_mismatches(obj, state), []
    else:
        problems, dtypes = [], []
    if problems:
        raise CheckpointError(
            f"Cannot restore {name!r} ({type(obj).__qualname__}) from {file}: {'; '.join(problems)}. "
            "Nothing was changed; restore into an object built like the one that was saved."
        )
    if dtypes:
        raise CheckpointError(
            f"Restoring {name!r} from {file} did not reproduce the saved state in a check before "
            "copying: the object cannot hold the saved values exactly "
            f"({_some(dtypes, quote=False)}). Nothing was changed; restore into an object built like "
            "the one that was saved (same dtypes)."
        )


def _module_mismatches(module: torch.nn.Module, state: Any, *, dtypes: bool) -> tuple[list[str], list[str]]:
    """What ``module.load_state_dict(state, strict=True)`` would refuse after copying part of it
    (missing and unexpected keys, shapes), and, with ``dtypes``, the dtypes it would convert."""
    if not isinstance(state, Mapping):
        return [], []  # load_state_dict refuses it before copying anything
    current = module.state_dict(keep_vars=True)
    problems, conversions = [], []
    missing = [k for k in current if k not in state]
    unexpected = [k for k in state if k not in current]
    if missing:
        problems.append(f"Missing key(s) in the checkpoint: {_some(missing)}")
    if unexpected:
        problems.append(f"Unexpected key(s) in the checkpoint: {_some(unexpected)}")
    for key, have in current.items():
        saved = state.get(key)
        if not isinstance(have, torch.Tensor) or key not in state or torch.nn.parameter.is_lazy(have):
            continue
        if not isinstance(saved, torch.Tensor):
            problems.append(f"{key} is a {type(saved).__name__} in the checkpoint, a tensor in the module")
        elif saved.shape != have.shape and not (have.dim() == 0 and saved.shape == (1,)):
            problems.append(
                f"size mismatch for {key}: the checkpoint holds shape {tuple(saved.shape)}, the module "
                f"{tuple(have.shape)}"
            )
        elif dtypes and saved.dtype != have.dtype:
            conversions.append(f"{key} is {saved.dtype} in the checkpoint, {have.dtype} in the module")
    return problems, conversions


def _optimizer_mismatches(optimizer: torch.optim.Optimizer, state: Any) -> list[str]:
    """The parameter-group mismatch ``Optimizer.load_state_dict`` would refuse."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        return []  # malformed: load_state_dict refuses it before changing anything
    saved = [len(g["params"]) for g in groups]
    have = [len(g["params"]) for g in optimizer.param_groups]
    if saved == have:
        return []
    return [f"the checkpoint has parameter groups of {saved} parameters, the optimizer {have}"]


def _some(items: list[str], limit: int = 10, *, quote: bool = True) -> str:
    shown = ", ".join(repr(k) if quote else k for k in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _restore_one(file: Path, name: str, obj: Any, state: Any) -> None:
    try:
        if isinstance(obj, torch.nn.Module):
            obj.load_state_dict(state, strict=True)
        else:
            obj.load_state_dict(state)
    except ReproError as e:
        raise CheckpointError(f"Cannot restore {name!r} from {file}: {e}") from None
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        detail = " ".join(str(e).split())[:600]
        raise CheckpointError(
            f"Cannot restore {name!r} ({type(obj).__qualname__}) from {file}: {detail}. Restore into "
            "an object built like the one that was saved."
        ) from None


# --------------------------------------------------------------------------- latest


def latest_checkpoint(
    directory: str | os.PathLike[str], *, verify: bool = True, max_expanded_bytes: int | None = None
) -> str | None:
    """The most recently saved complete checkpoint in ``directory``, or ``None`` if there is none.

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
    _check_limit(max_expanded_bytes)
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"Checkpoint directory {root} does not exist or is not a directory.")
    # Never return a file that is not durable yet: wait for this process's fsyncs there rather
    # than skip their files (that would resume from an older checkpoint than the one just saved).
    _wait_pending(root)
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
                own = _rank_path(file, rank)
                _verify(_read(own, mmap=True, max_expanded_bytes=max_expanded_bytes), own)
            except CheckpointError as e:
                _skip(e)
                continue
        return str(file)
    return None


def _looks_like_checkpoint(file: Path) -> bool:
    """Named like a checkpoint (whatever it is: ``_read`` refuses, and the caller warns about, one
    that is not a readable file), or a regular file that starts like a torch zip file."""
    name = file.name
    if name.endswith(_io.TMP_SUFFIX) or _RANK_FILE.search(name):
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
    for r in range(1, meta["world_size"]):
        if not _rank_path(file, r).is_file():
            raise CheckpointError(
                f"Checkpoint {file} is incomplete: rank {r}'s file {_rank_path(file, r).name} is missing."
            )
        other = _read(_rank_path(file, r), mmap=True, max_expanded_bytes=max_expanded_bytes)
        if other["meta"]["sequence"] != meta["sequence"] or other["meta"]["world_size"] != meta["world_size"]:
            raise CheckpointError(
                f"Checkpoint {file} is incomplete: rank {r}'s file {_rank_path(file, r).name} is from "
                "another save (different save sequence or world size)."
            )


def _skip(error: CheckpointError) -> None:
    warn_once(f"checkpoint-skip:{error}", f"Skipping checkpoint: {error}", ReproWarning, stacklevel=3)
