"""Forked children for the tests: each run is a new process, without paying the imports again.

Used by the scripts the tests start (they put this folder on ``sys.path``). ``start`` forks a
child that runs one function and exits with its code; ``serve`` is a fork server (a *zygote*)
that reads JSON commands on stdin: ``{"op": "run", "argv": [...], "env": {...}, "log": path}``
forks a child running ``main(argv)`` with ``env`` added and its output in ``log`` and answers its
pid; ``{"op": "wait", "pid": N}`` answers its exit code (``-9`` for SIGKILL).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


def start(work: Callable[[], int | None], *, log: str | os.PathLike[str] | None = None) -> int:
    """Fork a child that runs ``work`` (output to ``log`` when given) and exits with the code it
    returns (0 for ``None``, 1 for an exception, whose traceback it prints); return its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        if log is not None:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        result = work()
        code = 0 if result is None else int(result)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait(pid: int) -> int:
    """The exit code of child ``pid`` (negative: the signal that ended it)."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def serve(main: Callable[[list[str]], int | None], *, argv0: str | None = None) -> None:
    """Answer run/wait commands from stdin until it closes (see the module docstring)."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "run":

            def work(cmd: Any = cmd) -> int | None:
                os.environ.update(cmd["env"])
                argv = list(cmd["argv"])
                if argv0 is not None:
                    sys.argv = [argv0, *argv]
                return main(argv)

            print(start(work, log=cmd["log"]), flush=True)
        elif cmd["op"] == "wait":
            print(wait(cmd["pid"]), flush=True)
