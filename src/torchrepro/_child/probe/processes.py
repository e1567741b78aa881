"""The ``multiprocessing`` processes the script starts and joins, and which process this one is.

Invariants:
- ``ProcessWatcher`` wraps ``BaseProcess.start``/``join``/``_bootstrap``: each process the script
  starts is noted (the user's line, its target, the start method, its pid, the modules and
  tensors in shared memory among its arguments, and ``started``/``joined`` ticks on this
  process's ``watcher.Clock``). A DataLoader worker is never noted, and a process that runs one
  is ``disabled``: it writes nothing.
- In a process ``multiprocessing`` runs, the record names its target (``mp.spawn``: the function
  it wraps) and the start method, and is written when the target returns: such a process may
  leave with ``os._exit``, without ``atexit``.
- A fork of this process is a process of its own (``after_fork``): a new ``process`` record, no
  processes started yet, the clock at 0.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from torchrepro._child.probe.shared import shared_args
from torchrepro._child.probe.watcher import Clock, user_location

__all__ = ["ProcessWatcher"]

_WORKER_MODULE = "torch.utils.data._utils.worker"
"""The module of the DataLoader worker loop: a ``Process`` target that is never followed."""
_SPAWN_WRAPPER_MODULE = "torch.multiprocessing.spawn"
"""``mp.spawn`` starts ``_wrap(fn, i, ...)``: the user's function is its first argument."""


def _target_name(target: Any, args: Sequence[Any] = ()) -> str | None:
    """The name of a process's target (``mp.spawn``: the function it wraps)."""
    if target is None:
        return None
    if getattr(target, "__module__", None) == _SPAWN_WRAPPER_MODULE and args and callable(args[0]):
        target = args[0]
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return str(name or type(target).__name__)


class ProcessWatcher:
    """Records this process (``process``) and the processes it starts (``started``).

    ``main``: the process the audit started; ``write``: writes the probe's record (when a process
    this one runs ends).
    """

    def __init__(self, *, main: bool, clock: Clock, write: Callable[[], None]) -> None:
        self.clock = clock
        self._write = write
        self.disabled = False  # a DataLoader worker: writes nothing
        self.process: dict[str, Any] = {
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "main": main,
            "target": None,
            "start_method": None,
            "argv": None if main else [str(a) for a in getattr(sys, "orig_argv", sys.argv)[:4]],
        }
        self.started: list[dict[str, Any]] = []

    def install(self) -> None:
        """Note each ``multiprocessing`` process the script starts (where, which target, its pid,
        when it was joined), and write this process's record when one it runs ends: a process
        ``multiprocessing`` forked leaves with ``os._exit``, without ``atexit``."""
        import multiprocessing.process as mp_process

        watcher = self
        cls: Any = mp_process.BaseProcess
        original_start = cls.start
        original_join = cls.join
        original_bootstrap = cls._bootstrap

        @functools.wraps(original_start)
        def start(process: Any) -> None:
            target = getattr(process, "_target", None)
            record: dict[str, Any] | None = None
            if getattr(target, "__module__", None) != _WORKER_MODULE and not watcher.disabled:
                with contextlib.suppress(Exception):
                    args = tuple(getattr(process, "_args", ()))
                    record = {
                        "pid": None,
                        "location": user_location(),
                        "target": _target_name(target, args),
                        "start_method": None,
                        "started": watcher.clock.tick(),
                        "joined": None,
                        "shared_args": shared_args(args, getattr(process, "_kwargs", {})),
                    }
            original_start(process)
            if record is not None:
                record["pid"] = process.pid
                record["start_method"] = getattr(getattr(process, "_popen", None), "method", None)
                watcher.started.append(record)
                process._torchrepro_started = record

        @functools.wraps(original_join)
        def join(process: Any, *a: Any, **kw: Any) -> None:
            original_join(process, *a, **kw)
            record = getattr(process, "_torchrepro_started", None)
            if record is not None and record["joined"] is None and process.exitcode is not None:
                record["joined"] = watcher.clock.tick()

        @functools.wraps(original_bootstrap)
        def bootstrap(process: Any, *a: Any, **kw: Any) -> Any:
            if getattr(getattr(process, "_target", None), "__module__", None) == _WORKER_MODULE:
                watcher.disabled = True
                return original_bootstrap(process, *a, **kw)
            with contextlib.suppress(Exception):
                watcher._enter(process)
            try:
                return original_bootstrap(process, *a, **kw)
            finally:
                watcher._write()

        cls.start = start
        cls.join = join
        cls._bootstrap = bootstrap

    def after_fork(self) -> None:
        """In a fork: a process of its own, with a record of its own."""
        self.process = {
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "main": False,
            "target": None,
            "start_method": "fork",
            "argv": None,
        }
        self.started = []
        self.clock.reset()

    def collect(self) -> dict[str, Any]:
        return {"process": dict(self.process), "started": tuple(dict(r) for r in self.started)}

    def _enter(self, process: Any) -> None:
        """A ``multiprocessing`` process begins its target here."""
        self.process["target"] = _target_name(
            getattr(process, "_target", None), getattr(process, "_args", ())
        )
        if not self.process.get("start_method"):
            self.process["start_method"] = getattr(process, "_start_method", None)
