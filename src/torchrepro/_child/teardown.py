"""The ranks of a run end their process group together (torchrepro's children only).

With gloo, when one rank tears its process group down (``destroy_process_group``, or the
interpreter's exit) while another rank's last collective is still in flight, that rank's gloo
thread fails where it cannot throw and the process aborts ("terminate called without an active
exception", SIGABRT), after its training finished. torch 2.13 on the CPU, plain ``torchrun`` of a
2-rank DDP script, no torchrepro: 2 of 8 runs aborted with ``destroy_process_group()`` at its end,
3 of 10 without it, 0 of 10 with a barrier before it. A check then said "the script failed".

Invariants:
- ``install`` wraps ``torch.distributed.destroy_process_group``: before the default group of a
  gloo world of several ranks is destroyed, every rank waits for the others
  (``monitored_barrier``, with a timeout of a minute: a rank that never comes is named by gloo
  and not waited for past it). Other groups and backends are destroyed as the script asks.
- ``finish`` (at the end of a run that ended without an error: a failed rank exits at once, so
  its launcher ends the others) does the same for a default group the script left alive, then
  destroys it, so nothing is left for the interpreter's exit to race.
- It orders the teardown only: it never changes what the script computed, and an error in it is
  printed and ignored (the run's exit code is the script's).
- The barrier is not always enough: objects the script still holds (DDP's reducer) keep the gloo
  group's connections alive into the interpreter's finalization, and a rank whose peer has already
  exited could still abort there (seen under load in about 1 of 60 checks of a 2-rank DDP script
  with ``--steps``, after its training had finished). So a process that ended a gloo world of
  several ranks cleanly ends with ``end_process``: everything a normal exit does for the script
  (its non-daemon threads joined, its ``atexit`` functions run, files it left open flushed, the
  standard streams flushed), then ``os._exit`` with its exit code, skipping only the destruction of
  the C++ objects where the abort happens: the ranks the bootstrap runs (``bootstrap.main``) and
  the ``multiprocessing`` ranks a script spawns itself (``children``, once their target returned).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import gc
import io
import os
import sys
import threading
from typing import Any, NoReturn

__all__ = ["end_process", "ended_a_world", "finish", "install"]

TIMEOUT = datetime.timedelta(seconds=60)
_state = {"world": False}  # whether this process waited for its peers at the end of a gloo world


def _wait_for_the_others(dist: Any) -> None:
    """A barrier among the default group's ranks when it is gloo with several ranks."""
    try:
        if not dist.is_initialized() or dist.get_world_size() < 2 or dist.get_backend() != "gloo":
            return
        dist.monitored_barrier(timeout=TIMEOUT)
        _state["world"] = True
    except Exception as exc:  # a rank that left early: gloo names it; the teardown goes on
        print(f"torchrepro: the ranks did not end together ({type(exc).__name__}: {exc})", file=sys.stderr)


def install() -> None:
    """Make ``torch.distributed.destroy_process_group`` of the default group wait for every rank."""
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or getattr(dist.destroy_process_group, "_torchrepro", False):
        return
    original = dist.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if group is None:
            _wait_for_the_others(dist)
        original(group)

    destroy_process_group._torchrepro = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group


def finish() -> None:
    """End a default group the script left alive: wait for every rank, then destroy it."""
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()  # the wrapped one: waits for the others first
    except Exception as exc:
        print(f"torchrepro: could not end the process group ({type(exc).__name__}: {exc})", file=sys.stderr)


def ended_a_world() -> bool:
    """Whether this process ended a gloo world of several ranks (its peers may exit before it)."""
    return _state["world"]


def end_process(code: int) -> NoReturn:
    """End the process as a normal exit would for the script, without finalizing the interpreter:
    join the non-daemon threads, run the ``atexit`` functions, flush every open file and the
    standard streams, then ``os._exit(code)``."""
    try:
        current = threading.current_thread()
        for thread in threading.enumerate():
            if thread is not current and not thread.daemon and thread.is_alive():
                thread.join()
        atexit._run_exitfuncs()
        for obj in gc.get_objects():  # what finalization would flush: files the script left open
            if issubclass(type(obj), io.IOBase) and obj is not sys.stdout and obj is not sys.stderr:
                with contextlib.suppress(Exception):  # a broken or detached file: finalization ignores it
                    if not obj.closed and obj.writable():
                        obj.flush()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
