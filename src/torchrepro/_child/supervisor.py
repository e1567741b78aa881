"""The supervisor: ``python -m torchrepro._child.supervisor PARENT_PID [--overlay JSON] -- command...``.

Every child torchrepro starts runs under one (``launch.spawn``), so that whatever happens to
torchrepro, nothing it started outlives it. Invariants:
- It is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): every process below it that loses
  its parent (a script's own children, DataLoader workers, torchrun ranks in their own sessions)
  is reparented to it, so the whole tree stays findable.
- When the script ends, everything left below it is ended; the supervisor exits with the
  script's exit code, or 128+N when a signal N killed it.
- When torchrepro dies (even by SIGKILL: ``PR_SET_PDEATHSIG``), or sends SIGTERM or SIGHUP, the
  whole tree is stopped and killed at once, silently (no process gets to print a traceback). The
  script's process itself dies (SIGKILL, ``PR_SET_PDEATHSIG`` armed before its exec) when the
  supervisor dies, however: a supervisor killed while it was starting the script leaves nothing.
- SIGINT is left to the script (a Ctrl-C in a terminal reaches it directly, and it shows the
  user's own traceback); the supervisor itself ignores it.
- With ``--overlay`` (``check``'s runs) it enters the run's write isolation (``_child.overlay``)
  before anything else, so the script and everything it starts share one private view of the
  working directory; when that fails it starts nothing and exits 2 with one line saying why.
- Imports only the standard library; on other systems it degrades to a plain wait.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from torchrepro._child.overlay import Overlay, OverlayError, enter
from torchrepro._proc import children, exit_code, kill_tree

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no C library to load
        return None


_LIBC = _libc()  # loaded once, before any fork: the forked child only calls into it


def _prctl(option: int, value: int) -> bool:
    try:
        return bool(_LIBC.prctl(option, value, 0, 0, 0) == 0)
    except AttributeError:  # not Linux
        return False


def _die_with(parent: int) -> Callable[[], None]:
    """What the script's process runs between fork and exec: it gets SIGKILL when the supervisor
    dies, however it dies (a supervisor killed by the parent's ``kill_tree`` while the script was
    being started leaves no script behind); a supervisor already gone ends it at once."""

    def arm() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(128 + signal.SIGKILL)

    return arm


def _end_tree() -> None:
    """Stop and kill everything below this process, then reap it. Orphans below us are
    reparented to us, so they are children too; one may appear while others are ended (a process
    started just then), so this repeats until no child is left."""
    for _ in range(10):
        below = children(os.getpid())
        if not below:
            break
        for child in below:
            kill_tree(child)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


class _Stopped(Exception):
    """Raised by the stop handler, so that a blocking wait ends instead of being retried."""


def main(argv: list[str]) -> int:
    """Run ``argv``'s command under supervision; return the exit code to report."""
    overlay: Overlay | None = None
    if len(argv) >= 3 and argv[1] == "--overlay":
        try:
            overlay = Overlay.from_arg(argv[2])
        except ValueError:
            argv = []
        else:
            argv = [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print(
            "usage: python -m torchrepro._child.supervisor PARENT_PID [--overlay JSON] -- command...",
            file=sys.stderr,
        )
        return 2
    parent, command = int(argv[0]), argv[2:]
    if overlay is not None:  # first: unsharing a user namespace needs a single-threaded process
        try:
            enter(overlay)
        except OverlayError as exc:
            print(f"torchrepro: cannot isolate the run's writes: {exc}", file=sys.stderr)
            return 2
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    stop = {"signal": 0}

    def on_stop(signum: int, frame: Any) -> None:
        # Ending the tree here would reap the script, and the wait below, retried after the
        # handler, would then wait for whatever orphan is left: it must end instead.
        stop["signal"] = signum
        raise _Stopped

    def note_stop(signum: int, frame: Any) -> None:
        stop["signal"] = stop["signal"] or signum

    # Armed before the handlers: a SIGTERM in between ends this process by default, and nothing
    # has been started yet that could outlive it.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # torchrepro died before the death signal was armed
        return 128 + signal.SIGTERM
    code: int | None = None
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_stop)
    try:
        try:
            # preexec_fn is safe here: the supervisor runs no other thread
            proc = subprocess.Popen(command, preexec_fn=_die_with(os.getpid()))
        except OSError as exc:
            print(f"torchrepro: cannot start {command[0]!r}: {exc}", file=sys.stderr)
            return 2
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # after the start: the script keeps its handler
        while code is None:
            try:
                pid, status = os.waitpid(-1, 0)  # the script, or an orphan reparented to us
            except ChildProcessError:
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            if pid == proc.pid:
                proc.returncode = code = exit_code(os.waitstatus_to_exitcode(status))
    except _Stopped:
        pass
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the clean-up short
        signal.signal(sig, note_stop)
    _end_tree()
    if stop["signal"]:
        return 128 + stop["signal"]
    return 0 if code is None else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
