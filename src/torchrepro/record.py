"""Run records: a fingerprint of every init, batch, optimizer step and recorded value, per rank.

A run record is a directory (default ``.torchrepro/runs/<id>/``) holding ``command.json``,
``settings.json``, ``env.json`` and one ``events.rank<R>.jsonl`` per rank. Invariants:
- Events are appended and flushed as they happen (one JSON object a line), so a crashed or
  killed run keeps everything it recorded up to the crash and a reader can tail the file live.
- Every event has ``kind`` (``init``, ``data``, ``compute``, ``record``), ``key`` (which
  optimizer, loader or recorded name), ``step``, ``fp`` (``torchrepro.fingerprint`` of the
  event's value) and ``t``: one entry per tensor leaf (its fingerprint, dtype, shape, and its
  values when it has at most ``values_max`` elements, so ``compare`` can report the largest
  absolute difference of a small tensor). Two runs agree at an event iff the events are equal
  in ``kind``, ``key``, ``step`` and ``fp``.
- Recording changes nothing the script computes: hooks only read tensors (no RNG draw, no copy
  back) and are installed only by the bootstrap (``install_hooks``), never on import.
- ``torchrepro.record(name, value)`` adds a ``record`` event to the current run record; outside
  a recorded run (plain ``python``) it is a no-op, so scripts can call it unconditionally.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

__all__ = [
    "EVENT_KINDS",
    "Recorder",
    "active_recorder",
    "events_path",
    "install_hooks",
    "new_run_id",
    "read_events",
    "record",
]

EVENT_KINDS = ("init", "data", "compute", "record")
"""The kinds of recorded events, in the order they can first occur in a training step."""

_VALUES_MAX_DEFAULT = 64

_active: Recorder | None = None

trace_pause: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
"""Set by the bootstrap while an op tracer runs: a context manager pausing it. DataLoader fetches
and the recorder's own fingerprinting run under it, so a trace holds only the script's compute
(the main thread's ops that rebuild batches from worker processes vary with timing)."""


def _paused() -> contextlib.AbstractContextManager[Any]:
    pause = trace_pause
    return contextlib.nullcontext() if pause is None else pause()


def new_run_id() -> str:
    """A run id unique across processes and machines: UTC time, pid and 48 random bits.

    It draws from ``os.urandom``, never from an RNG a script could have seeded.
    """
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{stamp}-{os.getpid()}-{os.urandom(6).hex()}"


def events_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """The events file of ``rank`` in the run record ``run_dir``."""
    return Path(run_dir) / f"events.rank{rank}.jsonl"


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete event in an events file (a torn last line from a crash is ignored)."""
    events: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            events.append(json.loads(line))
    return events


def _fingerprint(obj: Any) -> str:
    from torchrepro.fingerprint import fingerprint

    return fingerprint(obj)


def _flatten(obj: Any, leaves: list[torch.Tensor], depth: int = 0) -> Any:
    """The structure of ``obj`` with tensor leaves replaced by their index in ``leaves``."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return {"tensor": len(leaves) - 1}
    if depth > 32:
        return f"<{type(obj).__name__}>"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, bytes):
        return {"bytes": obj.hex()}
    if isinstance(obj, dict):
        return {
            "dict": [[_flatten(k, leaves, depth + 1), _flatten(v, leaves, depth + 1)] for k, v in obj.items()]
        }
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [_flatten(v, leaves, depth + 1) for v in obj]}
    if hasattr(obj, "__array__") and hasattr(obj, "dtype"):  # a NumPy array or scalar
        try:
            leaves.append(torch.as_tensor(obj))
            return {"tensor": len(leaves) - 1}
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(obj, torch.nn.Module):
        return _flatten(obj.state_dict(), leaves, depth + 1)
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict) and isinstance(obj, torch.optim.Optimizer):
        return _flatten(state_dict(), leaves, depth + 1)
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"


def _leaf_entry(t: torch.Tensor, values_max: int) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "fp": _fingerprint(t),
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
    }
    if 0 < t.numel() <= values_max and not t.is_complex() and t.layout == torch.strided:
        entry["v"] = t.detach().reshape(-1).to("cpu", torch.float64).tolist()
    return entry


def _digest(obj: Any, values_max: int) -> tuple[str, list[dict[str, Any]]]:
    leaves: list[torch.Tensor] = []
    skeleton = _flatten(obj, leaves)
    entries = [_leaf_entry(t, values_max) for t in leaves]
    fp = _fingerprint([json.dumps(skeleton, sort_keys=True), [e["fp"] for e in entries]])
    return fp, entries


class Recorder:
    """Appends events of one process (one rank) to its events file, flushing each one.

    Counters live here: optimizers and loaders are numbered in the order this process first
    sees them, steps are counted per optimizer and batches per loader (across epochs).
    """

    def __init__(self, path: str | os.PathLike[str], *, values_max: int = _VALUES_MAX_DEFAULT) -> None:
        self.path = Path(path)
        self.values_max = values_max
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()
        self._seq = 0
        self._pid = os.getpid()
        self.optimizer_steps: dict[int, int] = {}
        self.loader_batches: dict[int, int] = {}
        self.n_optimizers = 0
        self.n_loaders = 0

    def write(self, kind: str, key: str, step: int, value: Any) -> None:
        """Fingerprint ``value`` and append one event (not from forked DataLoader workers)."""
        if os.getpid() != self._pid:  # a forked worker inherited the recorder: its order is not ours
            return
        with _paused():
            fp, leaves = _digest(value, self.values_max)
        event = {"i": self._seq, "kind": kind, "key": key, "step": step, "fp": fp, "t": leaves}
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return
            self._seq += 1
            self._file.write(line)
            self._file.flush()

    @property
    def current_step(self) -> int:
        """Optimizer steps completed so far by the first optimizer (0 before any step)."""
        return self.optimizer_steps.get(0, 0)

    def close(self) -> None:
        """Flush and close the events file (idempotent)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


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


StepCallback = Callable[[torch.optim.Optimizer, int, int], None]
"""Called after every recorded optimizer step with (optimizer, optimizer index, step index)."""

InitCallback = Callable[[torch.optim.Optimizer, int], None]
"""Called after an optimizer is created with (optimizer, optimizer index)."""


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def install_hooks(
    recorder: Recorder | None,
    *,
    num_workers: Callable[[int], int] | None = None,
    on_init: InitCallback | None = None,
    on_step: StepCallback | None = None,
) -> None:
    """Install the process-global recording hooks (the bootstrap calls this once per process).

    ``recorder`` receives the events (None: only the callbacks run). ``num_workers`` maps the
    ``num_workers`` every DataLoader is created with to the value actually used (``--vary
    workers``). ``on_init``/``on_step`` run after the recorder's own event is written.
    """
    global _active
    _active = recorder
    optim_cls = torch.optim.Optimizer
    original_init = optim_cls.__init__

    def init_wrapper(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if hasattr(self, "_torchrepro_index"):
            return
        index = recorder.n_optimizers if recorder is not None else _counter("optim")
        if recorder is not None:
            recorder.n_optimizers += 1
            recorder.optimizer_steps[index] = 0
        self._torchrepro_index = index  # type: ignore[attr-defined]
        if recorder is not None:
            recorder.write("init", f"optimizer{index}", 0, _params(self))
        if on_init is not None:
            on_init(self, index)

    optim_cls.__init__ = init_wrapper  # type: ignore[method-assign]

    def step_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        index: int = getattr(opt, "_torchrepro_index", 0)
        if recorder is not None:
            step = recorder.optimizer_steps.get(index, 0)
            recorder.optimizer_steps[index] = step + 1
            recorder.write("compute", f"optimizer{index}", step, _params(opt))
        else:
            step = _counter(f"step{index}")
        if on_step is not None:
            on_step(opt, index, step)

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(step_hook)

    from torch.utils.data import dataloader as dl

    if num_workers is not None:
        _patch_num_workers(dl.DataLoader, num_workers)
    _patch_loader_iteration(dl, recorder)


_counters: dict[str, int] = {}


def _counter(name: str) -> int:
    value = _counters.get(name, 0)
    _counters[name] = value + 1
    return value


def _patch_num_workers(loader_cls: type, mapping: Callable[[int], int]) -> None:
    original_init = loader_cls.__init__  # type: ignore[misc]
    signature = inspect.signature(original_init)

    def init_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        new = mapping(int(arguments.get("num_workers", 0) or 0))
        arguments["num_workers"] = new
        if new == 0:
            arguments["prefetch_factor"] = None
            arguments["persistent_workers"] = False
        original_init(*bound.args, **bound.kwargs)

    loader_cls.__init__ = init_wrapper  # type: ignore[misc]


def _patch_loader_iteration(dl: Any, recorder: Recorder | None) -> None:
    loader_cls = dl.DataLoader
    iter_cls = dl._BaseDataLoaderIter
    original_iter = loader_cls.__iter__
    original_next = iter_cls.__next__

    def iter_wrapper(self: Any) -> Any:
        with _paused():
            it = original_iter(self)
        key = self.__dict__.get("_torchrepro_loader")
        if key is None and recorder is not None:
            key = recorder.n_loaders
            recorder.n_loaders += 1
            recorder.loader_batches[key] = 0
            object.__setattr__(self, "_torchrepro_loader", key)
        it._torchrepro_loader = key
        return it

    def next_wrapper(self: Any) -> Any:
        with _paused():
            batch = original_next(self)
        key = self.__dict__.get("_torchrepro_loader")
        if key is not None and recorder is not None:
            index = recorder.loader_batches.get(key, 0)
            recorder.loader_batches[key] = index + 1
            recorder.write("data", f"loader{key}", index, batch)
        return batch

    loader_cls.__iter__ = iter_wrapper
    iter_cls.__next__ = next_wrapper
