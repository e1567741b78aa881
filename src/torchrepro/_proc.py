"""Process trees: list and end a process and everything below it, and supervise a child.

Invariants:
- Imports only the standard library (the supervisor runs it before any torch import).
- ``kill_tree`` leaves nothing of a tree alive: every process is stopped first (so none can fork
  a new one), the tree listed again, then everything killed; new sessions are included (torchrun
  ranks), and orphans reparented to a subreaper are found through it.
- ``exit_code`` reports a death by signal N as 128+N, as a shell does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

__all__ = ["children", "descendants", "exit_code", "kill_tree"]


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def children(pid: int) -> list[int]:
    """The live direct children of ``pid``, from ``/proc``; empty elsewhere."""
    return _children_map().get(pid, [])


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from ``/proc``; empty elsewhere."""
    tree = _children_map()
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int, *, grace: float = 0.0) -> None:
    """End ``pid`` and every process below it (new sessions included, e.g. torchrun ranks).

    With ``grace`` > 0 the tree first gets SIGTERM and that long to exit. Then every process is
    stopped (so none can fork a new one), the tree listed again, and everything killed.
    """
    if grace > 0:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)
    seen: set[int] = set()
    for _ in range(5):
        found = [p for p in [pid, *descendants(pid)] if p not in seen]
        if not found:
            break
        for p in found:
            seen.add(p)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGSTOP)
    for p in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return waited == 0


def exit_code(returncode: int) -> int:
    """A ``Popen.returncode`` as a shell reports it: death by signal N (``-N``) is 128+N.

    >>> exit_code(0), exit_code(3), exit_code(-2), exit_code(-9)
    (0, 3, 130, 137)
    """
    return 128 - returncode if returncode < 0 else returncode
