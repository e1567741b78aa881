"""Run records on disk: the one module that names their files, writes and reads them.

A run record is a directory (``torchrepro run``: ``.torchrepro/runs/<id>/``; ``check``: one
``run<i>/`` per run below ``.torchrepro/checks/<id>/``) holding:

- ``command.json``: the argv and working directory the run was started with;
- ``settings.json``: the run's ``RunSettings`` (seed, mode, threads, what was varied...);
- ``env.json``: the environment fingerprint, written by rank 0 of the child;
- ``events.rank<R>.jsonl``: one JSON event a line per rank, appended and flushed as they happen;
- ``trace-step<K>.rank<R>``: op traces of optimizer step K (``run --trace-step K``);
- ``stdout.log`` / ``stderr.log``: the run's output, when a check captured it;
- ``verdict.json``: a check's verdict, at the top of its check directory.

Invariants: every other module gets these names from here; JSON files are written atomically
(``_io``); readers name the file and what is wrong with it (``EnvFileError``), and a torn last
events line (a killed run) is ignored. This module imports no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrepro._io import atomic_write_json
from torchrepro.errors import EnvFileError, LaunchError, SettingsError

__all__ = [
    "COMMAND_FILE",
    "ENV_FILE",
    "LOCK_FILE",
    "SETTINGS_FILE",
    "STDERR_FILE",
    "STDOUT_FILE",
    "TRACE_PREFIX",
    "VERDICT_FILE",
    "EventTail",
    "RunRecord",
    "RunSettings",
    "claim",
    "events_path",
    "load_run",
    "new_run_dir",
    "new_run_id",
    "ops_path",
    "read_events",
    "read_json",
    "stale_traces",
    "trace_path",
    "trace_prefix",
    "write_env",
    "write_run_files",
    "write_verdict",
]

COMMAND_FILE = "command.json"
SETTINGS_FILE = "settings.json"
ENV_FILE = "env.json"
VERDICT_FILE = "verdict.json"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
TRACE_PREFIX = "trace-step"
"""Op traces in a run record are ``<TRACE_PREFIX><step>.rank<R>``."""
LOCK_FILE = ".torchrepro-lock"
"""Held (``flock``) by the run writing a record directory; ignored when a directory is checked."""

_EVENTS_RE = re.compile(r"^events\.rank(\d+)\.jsonl$")
_TRACE_RE = re.compile(r"^" + re.escape(TRACE_PREFIX) + r"(\d+)\.rank(\d+)$")
_OPS_GLOB = "*.rank*.json"


def new_run_id() -> str:
    """A run id unique across processes and machines: UTC time, pid and 48 random bits.

    It draws from ``os.urandom``, never from an RNG a script could have seeded.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{stamp}-{os.getpid()}-{os.urandom(6).hex()}"


def new_run_dir(root: str | os.PathLike[str] = ".torchrepro/runs") -> Path:
    """Create and return a fresh run directory under ``root`` (never an existing one)."""
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        path = base / new_run_id()
        try:
            path.mkdir()
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
        return path
    raise LaunchError(f"could not create a unique run directory under {base}")  # pragma: no cover


def events_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """The events file of ``rank`` in the run record ``run_dir``."""
    return Path(run_dir) / f"events.rank{rank}.jsonl"


def trace_prefix(run_dir: str | os.PathLike[str], step: int) -> Path:
    """Where a run traces step ``step``: each rank writes ``trace_path(<this>, rank)``."""
    return Path(run_dir).resolve() / f"{TRACE_PREFIX}{step}"


def trace_path(prefix: str | os.PathLike[str], rank: int) -> Path:
    """The op trace file of ``rank`` for a trace prefix (``trace_prefix`` or a check's own)."""
    return Path(f"{os.fspath(prefix)}.rank{rank}")


def ops_path(prefix: str | os.PathLike[str], rank: int) -> Path:
    """The audit's op recording of ``rank`` for an ops prefix."""
    return Path(f"{os.fspath(prefix)}.rank{rank}.json")


def ops_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Every op recording (``ops_path``) in ``directory``, in rank order of their names."""
    return sorted(Path(directory).glob(_OPS_GLOB))


def stale_traces(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The op traces already in ``run_dir`` (a reused record: old traces would mislead)."""
    return sorted(p for p in Path(run_dir).glob(f"{TRACE_PREFIX}*.rank*") if _TRACE_RE.match(p.name))


def _is_record_file(name: str) -> bool:
    fixed = (COMMAND_FILE, SETTINGS_FILE, ENV_FILE, VERDICT_FILE, STDOUT_FILE, STDERR_FILE)
    return name in fixed or bool(_EVENTS_RE.match(name) or _TRACE_RE.match(name))


@contextlib.contextmanager
def claim(run_dir: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[Path]:
    """Hold ``run_dir`` for one run's record, refusing one that already holds files.

    A directory that does not exist is created; an empty one is taken. A directory holding files
    is refused (``SettingsError``, nothing touched) unless ``overwrite``: then the record files
    in it are removed (other files are kept). While held, a second run into the same directory
    is refused (an ``flock`` on ``LOCK_FILE``), so two runs never interleave their events.
    """
    root = Path(run_dir)
    hint = "give a new or empty directory"
    if root.exists() and not root.is_dir():
        raise SettingsError(f"record directory {os.fspath(root)!r} is a file, not a directory; {hint}")

    def others() -> list[str]:
        return sorted(p.name for p in root.iterdir() if p.name != LOCK_FILE) if root.is_dir() else []

    def refuse(names: list[str]) -> SettingsError:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return SettingsError(
            f"record directory {os.fspath(root)!r} already holds {len(names)} file(s) ({shown}); "
            f"{hint}, or pass --overwrite to replace the record in it (other files are kept)"
        )

    if others() and not overwrite:
        raise refuse(others())
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise SettingsError(
            f"cannot create the record directory {os.fspath(root)!r}: {exc}; {hint}"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SettingsError(
                f"record directory {os.fspath(root)!r} is being written by another run right now; "
                "give each run its own directory"
            ) from None
        if overwrite:
            for name in others():
                if _is_record_file(name):
                    (root / name).unlink()
        elif others():  # a file appeared since the check above
            raise refuse(others())
        yield root
    finally:
        os.close(fd)


@dataclass(frozen=True)
class RunSettings:
    """``settings.json``: how a run was started. ``None`` = not set / not applicable.

    ``run`` is the run's index within a check; ``steps``/``vary`` are the check's options;
    ``trace_step``/``trace_optimizer`` say which step's ops were traced into the record;
    ``PYTHONHASHSEED``/``OMP_NUM_THREADS`` are the values the child was started with.
    """

    seed: int | None = None
    mode: str | None = None
    threads: int | None = None
    nproc: int | None = None
    script: str | None = None
    module: str | None = None
    cpu_capability: str | None = None
    trace_step: int | None = None
    trace_optimizer: int | None = None
    steps: int | None = None
    vary: str | None = None
    run: int | None = None
    PYTHONHASHSEED: str | None = None
    OMP_NUM_THREADS: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunSettings:
        """Read ``settings.json``: unknown keys ignored, a value of the wrong type read as unset."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = d.get(f.name)
            want = int if "int" in str(f.type) else str
            if isinstance(value, want) and not isinstance(value, bool):
                values[f.name] = value
        return cls(**values)


def write_run_files(run_dir: str | os.PathLike[str], command: Sequence[str], settings: RunSettings) -> None:
    """Write ``command.json`` and ``settings.json`` of a run record."""
    root = Path(run_dir)
    atomic_write_json(root / COMMAND_FILE, {"argv": list(command), "cwd": os.getcwd()})
    atomic_write_json(root / SETTINGS_FILE, settings.to_dict())


def write_env(run_dir: str | os.PathLike[str], env: Mapping[str, Any]) -> None:
    """Write ``env.json`` of a run record."""
    atomic_write_json(Path(run_dir) / ENV_FILE, dict(env))


def write_verdict(check_dir: str | os.PathLike[str], verdict: Mapping[str, Any]) -> None:
    """Write a check's ``verdict.json``."""
    atomic_write_json(Path(check_dir) / VERDICT_FILE, dict(verdict))


def read_json(path: str | os.PathLike[str]) -> Any:
    """A JSON file's value; ``EnvFileError`` naming the file when it is unreadable or not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise EnvFileError(f"cannot read {os.fspath(path)}: {exc}") from None


def _read_object(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    data = read_json(path)
    return data if isinstance(data, dict) else None


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete event in an events file (a torn last line from a crash is ignored)."""
    events: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            events.append(json.loads(line))
    return events


class EventTail:
    """Reads the complete events appended to a (possibly still growing) events file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> int:
        """Read newly completed lines; return how many events were added."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:  # rewritten (the process re-executed itself)
                    self.events.clear()
                    self._offset = 0
                    self._partial = b""
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        added = 0
        for line in lines:
            if line.strip():
                self.events.append(json.loads(line))
                added += 1
        return added


@dataclass(frozen=True)
class RunRecord:
    """A loaded run record: its directory, events per rank, environment and settings."""

    path: str
    events: dict[int, list[dict[str, Any]]]
    env: dict[str, Any] | None
    settings: RunSettings | None
    traces: dict[int, dict[int, str]] = field(default_factory=dict)
    """Op trace files: ``{step: {rank: path}}`` (runs recorded with ``--trace-step``)."""


def load_run(path: str | os.PathLike[str]) -> RunRecord:
    """Load a run record directory; ``ReproError`` naming it when it is not one."""
    root = Path(path)
    if not root.is_dir():
        raise EnvFileError(f"run record not found: {os.fspath(path)!r} is not a directory")
    events: dict[int, list[dict[str, Any]]] = {}
    traces: dict[int, dict[int, str]] = {}
    for entry in sorted(root.iterdir()):
        t = _TRACE_RE.match(entry.name)
        if t:
            traces.setdefault(int(t.group(1)), {})[int(t.group(2))] = os.fspath(entry)
        m = _EVENTS_RE.match(entry.name)
        if m:
            try:
                events[int(m.group(1))] = read_events(entry)
            except (OSError, ValueError) as exc:
                raise EnvFileError(f"cannot read events file {entry}: {exc}") from None
    if not events:
        raise EnvFileError(
            f"{os.fspath(path)!r} holds no events.rank<R>.jsonl file: not a torchrepro run record "
            "(record one with `torchrepro run --record DIR script.py`)"
        )
    try:
        env = _read_object(root / ENV_FILE)
        raw_settings = _read_object(root / SETTINGS_FILE)
    except EnvFileError as exc:
        raise EnvFileError(f"{exc}; the run record is damaged") from None
    return RunRecord(
        path=os.fspath(path),
        events=events,
        env=env,
        settings=None if raw_settings is None else RunSettings.from_dict(raw_settings),
        traces=traces,
    )
