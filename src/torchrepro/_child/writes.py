"""Which paths a check's run writes: python's audit hooks, in the run's script process.

``python -m torchrepro._child.writes [--] script.py|-m module [args]`` is the bootstrap's entry
for ``check``'s runs (and every rank of them): it installs the watch, then runs the bootstrap.

Invariants:
- Seen: every ``open`` for writing (builtin ``open``, ``io``, ``os.open``: flags with write, create,
  truncate or append), ``torch.save`` to a path (which opens its file in C++, so its ``open`` event
  is raised here), and ``os.rename``/``os.replace`` (both paths), ``os.remove``/``unlink``,
  ``os.mkdir``, ``os.rmdir``, ``os.symlink``, ``os.link``, ``os.truncate``, ``shutil.rmtree``.
  Not seen: writes by C/C++ code that opens files itself, by non-python processes and by python
  processes the script starts itself (DataLoader workers included).
- Each distinct path is appended once, absolute and with its directory's symlinks resolved, as
  one JSON line to ``<record_dir>/WRITES_FILE`` as soon as it is written (a run killed mid-way
  keeps its list); lines are short ``O_APPEND`` writes, so the ranks of a run share the file.
- The hook never raises (an audit hook that raises would fail the script's operation) and costs a
  set lookup for every other audit event.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchrepro.runrecord import WRITES_FILE

__all__ = ["main", "read_writes", "watch"]


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# event -> which arguments are paths, and the index of their dir_fd (None: none)
_PATH_EVENTS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.rename": ((0, 2), (1, 3)),
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.symlink": ((1, 2),),
    "os.link": ((1, 3),),
    "os.truncate": ((0, None),),
    "shutil.rmtree": ((0, 1),),
}


def _resolve(path: Any, dir_fd: Any) -> str | None:
    if isinstance(path, int) or path is None:
        return None
    text = os.fsdecode(path)
    if not os.path.isabs(text):
        base = os.getcwd()
        if isinstance(dir_fd, int) and dir_fd >= 0:
            base = os.readlink(f"/proc/self/fd/{dir_fd}")
        text = os.path.join(base, text)
    text = os.path.normpath(text)
    head, tail = os.path.split(text)
    return os.path.join(os.path.realpath(head), tail)


def watch(log: str | os.PathLike[str]) -> Callable[[str, tuple[Any, ...]], None]:
    """Append every path this process writes to ``log`` (see the module invariants); returns the hook."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    own = os.path.realpath(log)
    seen: set[str] = {own}
    busy = [False]

    def note(path: Any, dir_fd: Any, op: str) -> None:
        resolved = _resolve(path, dir_fd)
        if resolved is None or resolved in seen:
            return
        seen.add(resolved)
        line = json.dumps({"path": resolved, "op": op, "pid": os.getpid()}) + "\n"
        os.write(fd, line.encode("utf-8", "surrogateescape"))

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if busy[0] or (event != "open" and event not in _PATH_EVENTS):
            return
        busy[0] = True
        try:
            if event == "open":
                flags = args[2] if len(args) > 2 else 0
                mode = args[1] if len(args) > 1 else None
                writes = (isinstance(flags, int) and flags & _WRITE_FLAGS) or (
                    isinstance(mode, str) and any(c in mode for c in "wax+")
                )
                if writes:
                    note(args[0], None, event)
            else:
                for index, fd_index in _PATH_EVENTS[event]:
                    dir_fd = args[fd_index] if fd_index is not None and fd_index < len(args) else None
                    note(args[index], dir_fd, event)
        except Exception:  # never fail the script's own operation
            pass
        finally:
            busy[0] = False

    sys.addaudithook(hook)
    return hook


def _announce_torch_saves() -> None:
    """``torch.save(obj, path)`` opens ``path`` in C++ (no audit event): raise python's ``open``
    event for it first, so the watch sees it like any other write."""
    try:
        import torch.serialization as serialization
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    opener = serialization._open_zipfile_writer

    def open_zipfile_writer(name_or_buffer: Any) -> Any:
        if isinstance(name_or_buffer, (str, bytes, os.PathLike)):
            sys.audit("open", os.fspath(name_or_buffer), "wb", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        return opener(name_or_buffer)

    serialization._open_zipfile_writer = open_zipfile_writer


def read_writes(record_dir: str | os.PathLike[str]) -> set[str]:
    """The paths a run's script wrote (empty when it noted none; malformed lines are skipped)."""
    try:
        text = (Path(record_dir) / WRITES_FILE).read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return set()
    paths: set[str] = set()
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a torn last line (a killed run)
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            paths.add(entry["path"])
    return paths


def main(argv: list[str] | None = None) -> int:
    """Watch this process's writes into its run record, then run the bootstrap."""
    from torchrepro._child import bootstrap
    from torchrepro.protocol import ChildSpec

    try:
        record_dir = ChildSpec.from_env().record_dir
    except ValueError:  # the bootstrap says what is malformed
        record_dir = None
    if record_dir:
        try:
            watch(os.path.join(record_dir, WRITES_FILE))
        except OSError as exc:
            print(f"torchrepro: not watching the run's writes: {exc}", file=sys.stderr)
        else:
            _announce_torch_saves()
    return bootstrap.main(argv)


if __name__ == "__main__":
    sys.exit(main())
