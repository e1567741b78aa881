"""Recording a run: a fingerprint of every init, batch, optimizer step and recorded value, per rank.

The events go to the run record's ``events.rank<R>.jsonl`` (file names: ``runrecord``). Invariants:
- Events are appended and flushed as they happen (one JSON object a line), so a crashed or
  killed run keeps everything it recorded up to the crash and a reader can tail the file live.
- Every event has ``kind`` (``init``, ``data``, ``compute``, ``record``), ``key`` (which
  optimizer, loader or recorded name), ``step``, ``fp`` (``torchrepro.fingerprint`` of the
  event's value) and ``t``: one entry per tensor leaf (its fingerprint, dtype, shape, its name
  ``n`` when it has one, and its values when it has at most ``values_max`` elements, so
  ``compare`` can report the largest absolute difference of a small tensor; a larger contiguous
  floating tensor gets ``s``, ``SAMPLE_SIZE`` of its elements evenly spaced over the flat tensor, a
  lower bound of how far two runs are apart that the HTML report plots). A leaf's name is its
  path in a batch (``[0]``, ``["input_ids"]``) or, in ``init``/``compute`` events, the parameter,
  gradient or optimizer state it is (``_child.training``); a ``data`` event's ``src`` says where
  the script created the DataLoader. Two runs agree at an event iff the events are equal
  in ``kind``, ``key``, ``step`` and ``fp``.
- Recording changes nothing the script computes: hooks only read tensors (no RNG draw, no copy
  back) and are installed only by the child (``_child.hooks.install_recording``), never on import.
- ``torchrepro.record(name, value)`` adds a ``record`` event to the current run record; outside
  a recorded run (plain ``python``) it is a no-op, so scripts can call it unconditionally.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import torch

from torchrepro.events import EVENT_KINDS

__all__ = ["EVENT_KINDS", "Recorder", "activate", "active_recorder", "record"]

_VALUES_MAX_DEFAULT = 64
SAMPLE_SIZE = 8
"""Elements of a larger floating tensor kept as ``s`` (evenly spaced: ``flat[::numel // 8][:8]``)."""

_active: Recorder | None = None

trace_pause: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
"""Set by the bootstrap while an op tracer runs: a context manager pausing it. DataLoader fetches
and the recorder's own fingerprinting run under it, so a trace holds only the script's compute
(the main thread's ops that rebuild batches from worker processes vary with timing)."""


def paused() -> contextlib.AbstractContextManager[Any]:
    """Pause the active op tracer, if any (a no-op context otherwise)."""
    pause = trace_pause
    return contextlib.nullcontext() if pause is None else pause()


def _hashing() -> ModuleType:
    """``torchrepro.hashing``, imported at the first event (not when ``record`` is imported)."""
    global _hashing_module
    if _hashing_module is None:
        from torchrepro import hashing

        _hashing_module = hashing
    return _hashing_module


_hashing_module: ModuleType | None = None


def _flatten(
    obj: Any,
    leaves: list[torch.Tensor],
    names: list[str],
    path: str = "",
    depth: int = 0,
    whole: bool = False,
) -> Any:
    """The structure of ``obj`` with tensor leaves replaced by their index in ``leaves``.

    ``names`` receives each leaf's path in ``obj``: ``[0]``, ``["input_ids"]``, ``[1]["mask"]``.
    A DTensor (FSDP2) is this rank's shard, or with ``whole`` the whole tensor (an all-gather: every
    rank records at the same point; after the process group ended, a placeholder on every world size).
    """
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", None)
        if local is None and freed(obj):  # FSDP2's gathered parameter after it resharded
            return f"<freed {tuple(obj.shape)}>"
        if local is not None and whole:
            if not torch.distributed.is_initialized():
                return f"<sharded {tuple(obj.shape)}: not gathered, the process group ended>"
            local = obj.detach().full_tensor()  # type: ignore[attr-defined]
        leaves.append(obj if local is None else local)
        names.append(path)
        return {"tensor": len(leaves) - 1}
    if depth > 32:
        return f"<{type(obj).__name__}>"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, bytes):
        return {"bytes": obj.hex()}
    if isinstance(obj, dict):
        pairs = []
        for k, v in obj.items():
            key = _flatten(k, leaves, names, path, depth + 1, whole)
            pairs.append([key, _flatten(v, leaves, names, _sub(path, k), depth + 1, whole)])
        return {"dict": pairs}
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, leaves, names, f"{path}[{i}]", depth + 1, whole) for i, v in enumerate(obj)]
        return {type(obj).__name__: items}
    if hasattr(obj, "__array__") and hasattr(obj, "dtype"):  # a NumPy array or scalar
        try:
            leaves.append(torch.as_tensor(obj))
            names.append(path)
            return {"tensor": len(leaves) - 1}
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(obj, torch.nn.Module):
        return _flatten(obj.state_dict(), leaves, names, path, depth + 1, whole)
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and isinstance(obj, torch.optim.Optimizer):
        return _flatten(state_dict(), leaves, names, path, depth + 1, whole)
    if isinstance(obj, Mapping):  # a BatchEncoding or another mapping that is not a dict
        return _flatten(dict(obj.items()), leaves, names, path, depth + 1, whole)
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"


def freed(t: torch.Tensor) -> bool:
    """``t`` has elements but no memory behind them (FSDP2 frees a gathered parameter's storage
    when it reshards; the tensor object lives on)."""
    if (
        t.layout != torch.strided
        or t.is_meta
        or t.numel() == 0
        or type(t) not in (torch.Tensor, torch.nn.Parameter)
    ):
        return False
    try:
        return t.untyped_storage().nbytes() == 0
    except (RuntimeError, NotImplementedError):
        return False


def _sub(path: str, key: Any) -> str:
    shown = json.dumps(key) if isinstance(key, str) else repr(key)
    return f"{path}[{shown}]"


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _leaf_entry(t: torch.Tensor, values_max: int) -> dict[str, Any]:
    dtype = t.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    entry: dict[str, Any] = {"fp": _hashing().fingerprint(t), "dtype": name, "shape": list(t.shape)}
    if 0 < t.numel() <= values_max and not t.is_complex() and t.layout == torch.strided:
        flat = t.detach().reshape(-1)
        # Floating values become Python floats exactly as through float64; others are converted.
        if not (flat.is_floating_point() and flat.is_cpu):
            flat = flat.to("cpu", torch.float64)
        entry["v"] = flat.tolist()
    elif (
        t.numel() > max(values_max, SAMPLE_SIZE)
        and t.is_floating_point()
        and t.layout == torch.strided
        and not t.is_meta
        and t.is_contiguous()
    ):
        flat = t.detach().view(-1)[:: t.numel() // SAMPLE_SIZE][:SAMPLE_SIZE]  # a view: no copy
        entry["s"] = (flat if flat.is_cpu else flat.to("cpu", torch.float64)).tolist()
    return entry


def _digest(
    obj: Any, values_max: int, *, named: bool = False, whole: bool = False
) -> tuple[str, list[dict[str, Any]]]:
    """The event fingerprint of ``obj`` and an entry per tensor leaf (``n``: the leaf's name).

    ``named``: ``obj`` is a list of ``(name, value)`` pairs; a leaf's name is its pair's name
    (and the path inside the value, if the value is a container).
    """
    leaves: list[torch.Tensor] = []
    names: list[str] = []
    if named:
        skeleton: Any = [[name, _flatten(value, leaves, names, name, whole=whole)] for name, value in obj]
    else:
        skeleton = _flatten(obj, leaves, names, whole=whole)
    entries = [_leaf_entry(t, values_max) for t in leaves]
    fp = _hashing().fingerprint_texts(json.dumps(skeleton, sort_keys=True), [e["fp"] for e in entries])
    for entry, name in zip(entries, names, strict=True):
        if name:
            entry["n"] = name
    return fp, entries


class Recorder:
    """Appends events of one process (one rank) to its events file, flushing each one.

    Counters live here: optimizers and loaders are numbered in the order this process first
    sees them, steps are counted per optimizer and batches per loader (across epochs).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        values_max: int = _VALUES_MAX_DEFAULT,
        claim: Callable[[], tuple[Path, IO[str]] | None] | None = None,
        whole_shards: bool = False,
    ) -> None:
        """``path=None`` with ``claim``: the file is chosen at the first event, when the rank is
        known (a script-started rank); ``claim()`` returns the path and the open file, or None
        (this process records nothing). ``whole_shards``: DTensors are recorded whole (gathered),
        so runs on different world sizes compare (``check --vary world``), not as this rank's shard."""
        self.path = None if path is None else Path(path)
        self.values_max = values_max
        self.whole_shards = whole_shards
        self._claim = claim
        self._file: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()
        self._seq = 0
        self._pid = os.getpid()
        self.optimizer_steps: dict[int, int] = {}
        self.loader_batches: dict[int, int] = {}
        self.n_optimizers = 0
        self.n_loaders = 0
        self.backward_steps = 0
        """Steps counted by ``backward()`` for training no optimizer sees (``_child.training``)."""

    def write(
        self, kind: str, key: str, step: int, value: Any, *, named: bool = False, source: str | None = None
    ) -> None:
        """Fingerprint ``value`` and append one event (not from forked DataLoader workers).

        ``named``: ``value`` is a list of ``(name, value)`` pairs (see ``_digest``); ``source``:
        where the thing the event belongs to was created (a DataLoader's ``file:line``).
        """
        if os.getpid() != self._pid:  # a forked worker inherited the recorder: its order is not ours
            return
        if self._file is None and self._claim is None:  # closed, or nothing to record into
            return
        with paused():
            fp, leaves = _digest(value, self.values_max, named=named, whole=self.whole_shards)
        event: dict[str, Any] = {"i": self._seq, "kind": kind, "key": key, "step": step, "fp": fp}
        event["t"] = leaves
        if source is not None:
            event["src"] = source
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None and self._claim is not None:
                claim, self._claim = self._claim, None
                claimed = claim()
                if claimed is not None:
                    self.path, self._file = claimed
            if self._file is None:
                return
            self._seq += 1
            self._file.write(line)
            self._file.flush()

    @property
    def current_step(self) -> int:
        """Steps completed so far by the first optimizer, else by ``backward()`` (0 before any)."""
        return self.optimizer_steps.get(0, self.backward_steps)

    def close(self) -> None:
        """Flush and close the events file (idempotent)."""
        with self._lock:
            self._claim = None
            if self._file is not None:
                self._file.close()
                self._file = None


def activate(recorder: Recorder | None) -> None:
    """Make ``recorder`` the one ``record()`` writes to (the child's recording hooks call this)."""
    global _active
    _active = recorder


def active_recorder() -> Recorder | None:
    """The recorder of this process, when it runs under ``torchrepro run``/``check``."""
    return _active


def record(name: str, value: Any) -> None:
    """Add ``value`` (tensors, modules, numbers, nested containers) to the current run record.

    Under ``torchrepro run`` or ``check`` the value's fingerprint becomes a ``record`` event
    (``step`` = optimizer steps completed so far), compared across runs like every other event.
    Outside a recorded run it does nothing, so a script may call it unconditionally; so does a
    call from a DataLoader worker process (workers run concurrently: their order is not the run's).

    >>> record("loss", 0.25)  # plain python: nothing is recorded
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"record name must be a non-empty str, got {type(name).__name__} {name!r}")
    rec = _active
    if rec is not None:
        rec.write("record", name, rec.current_step, value)
