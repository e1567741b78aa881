"""A process of a run reaches the interpreter's exit only once torch's gloo worker threads are idle.

The cause of the abort at exit ("terminate called without an active exception", SIGABRT, after
the training finished; torch 2.13 on the CPU, plain ``torchrun`` of a 2-rank DDP script, 2 of 80
runs under load), read from core dumps: not a peer that left, but a race inside the aborting
process, which is usually the rank that exits *first*. Since torch stashes the autograd context
(a ``contextvars.Context``) in C++ thread-local state during every ``backward()``, each gloo work
a DDP gradient hook starts there copies that Python object into the work's captured
``at::ThreadLocalState``. The gloo worker thread (``pt_gloo_runloop``) holds the last reference to
a finished work and destroys it *after* completing its future, and destroying it decrefs the
object, which takes the GIL. When the main thread has meanwhile returned from the last
``backward()`` and entered ``Py_FinalizeEx``, ``take_gil`` ends the worker with
``pthread_exit``, whose forced unwind reaches the work's ``noexcept`` destructor:
``std::terminate``. A barrier before the end only narrows the window (the barrier's own work can
be destroyed late too). Upstream: pytorch/pytorch#190489 (the decref racing the interpreter's
finalization; pytorch/pytorch#179291 tried to destroy the groups at exit and was abandoned, and
DDP keeps its group alive past ``destroy_process_group`` anyway).

Invariants:
- ``install`` (at ``session.configure``, before the script's first line, so it runs after every
  ``atexit`` function the script registers) adds ``quiesce`` to the ``atexit`` functions, once per
  process. Nothing else changes: the interpreter's finalization runs as for plain python, so
  files the script left open are closed (a gzip trailer, a zip central directory).
- ``quiesce`` waits, with the GIL released, until every ``pt_gloo_runloop`` thread of the process
  is idle: blocked in its queue's untimed condition wait, and not scheduled at all between two
  looks 2 ms apart (a worker waiting for the GIL gets it meanwhile and finishes). A worker that
  does not become idle within ``TIMEOUT`` (a collective whose peer never comes) is left as plain
  python would leave it, with one line on stderr. Without ``/proc`` (not Linux) or gloo threads
  it returns at once. It orders the exit only: it never changes what the script computed.
"""

from __future__ import annotations

import atexit
import os
import platform
import sys
import time

__all__ = ["gloo_workers", "install", "quiesce"]

TIMEOUT = 10.0
"""Seconds ``quiesce`` waits for the gloo worker threads before leaving them as they are."""

_POLL = 0.002
_WORKER_NAME = "pt_gloo_runloop"  # torch's name for ProcessGroupGloo's worker threads
_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_CMD = 0x7F  # the op without FUTEX_PRIVATE_FLAG and FUTEX_CLOCK_REALTIME
_FUTEX_WAIT_BITSET = 9  # how glibc's pthread_cond_wait blocks
_TASKS = "/proc/self/task"
_installed = {"quiesce": False}


def install() -> None:
    """Register ``quiesce`` with ``atexit`` (once per process)."""
    if not _installed["quiesce"]:
        _installed["quiesce"] = True
        atexit.register(quiesce)


def gloo_workers() -> list[str]:
    """The thread ids of this process's gloo worker threads (none without ``/proc``)."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []
    workers = []
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm", encoding="utf-8", errors="replace") as f:
                if f.read().strip() == _WORKER_NAME:
                    workers.append(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return workers


def _look(tid: str) -> tuple[bool, tuple[str, ...]] | None:
    """Whether the thread may be idle (blocked in an untimed condition wait, or, where the system
    call cannot be read, blocked at all), and its scheduler counters (time on the CPU, times
    scheduled); None once it has ended."""
    try:
        with open(f"{_TASKS}/{tid}/schedstat", encoding="ascii") as f:
            ran = tuple(f.read().split()[0::2])
    except OSError:
        return None
    try:
        with open(f"{_TASKS}/{tid}/syscall", encoding="ascii") as f:
            call = f.read().split()
    except OSError:  # a kernel without it: the counters alone decide
        return True, ran
    if not call or call[0] == "running":
        return False, ran
    if _FUTEX is None:  # another architecture's numbers: blocked, and the counters decide
        return True, ran
    try:  # "<nr> <uaddr> <op> <val> <timeout> ...": blocked in futex(uaddr, op, val, timeout)
        waiting = (
            int(call[0]) == _FUTEX
            and int(call[2], 16) & _FUTEX_CMD == _FUTEX_WAIT_BITSET
            and int(call[4], 16) == 0
        )
    except (IndexError, ValueError):
        waiting = False
    return waiting, ran


def quiesce(timeout: float = TIMEOUT) -> bool:
    """Wait until every gloo worker thread is idle (see the module's invariants); whether they
    all were within ``timeout`` seconds."""
    if not gloo_workers():
        return True
    deadline = time.monotonic() + timeout
    before: dict[str, tuple[bool, tuple[str, ...]] | None] | None = None
    while True:
        looks = {tid: _look(tid) for tid in gloo_workers()}
        if looks == before and all(look is None or look[0] for look in looks.values()):
            return True
        if time.monotonic() > deadline:
            print(
                f"torchrepro: a gloo worker thread was still busy {timeout:g} s after the script "
                "ended (a collective without its peers?); exiting anyway",
                file=sys.stderr,
            )
            return False
        before = looks
        time.sleep(_POLL)  # the GIL released: a worker waiting for it finishes its work now
