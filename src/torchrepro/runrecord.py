"""Run records on disk: the one module that names their files, writes and reads them.

A run record is a directory (``torchrepro run``: ``.torchrepro/runs/<id>/``; ``check``: one
``run<i>/`` per run below ``.torchrepro/checks/<id>/``) holding:

- ``command.json``: the argv and working directory the run was started with;
- ``settings.json``: the run's ``RunSettings`` (seed, mode, threads, what was varied...);
- ``env.json``: the environment fingerprint, written by rank 0 of the child;
- ``events.rank<R>.jsonl``: one JSON event a line per rank, appended and flushed as they happen;
- ``world.rank<R>.json``: the rank and world size rank R saw when it joined a process group (so
  a check knows the ranks a script started itself, recorded or not);
- ``states.rank<R>.jsonl`` (``check --vary resume``): before every step of the first optimizer,
  the fingerprints of the RNG states, and before a process's first step those of the parameters
  and the optimizer state it starts from (``write``: ``_child.session``; ``read_states``);
- ``killpoint.rank<R>.json`` (``check --vary resume``): rank R reached the step the check kills
  the run before, and waits to be killed;
- ``uncovered.pid<P>.json``: a python child the script started that trained without a rank of
  its own (or whose rank was taken): its events were not recorded, and a check says so;
- ``trace-step<K>.rank<R>``: op traces of optimizer step K (``run --trace-step K``);
- ``<prefix>.rank<R>.pt`` / ``.json``: the inputs of one traced op call and the call described,
  captured for ``check --repro`` (``capture_paths``);
- ``stdout.log`` / ``stderr.log``: the run's output, when a check captured it;
- ``verdict.json``: a check's verdict, at the top of its check directory.

Invariants: every other module gets these names from here; JSON files are written atomically
(``_io``) and read strictly (``_jsonread``; its ``read_json`` is exported here too, for the parts
that read a record's files). Readers trust nothing they read: anything malformed (not UTF-8, not
JSON, NaN or an infinity outside an event's values, an integer beyond Python's digit limit,
nesting deeper than ``_jsonread.MAX_JSON_DEPTH``, an event of the wrong shape) is an
``EnvFileError`` naming the file (and, for events, the 1-based line) and what is wrong, never
another exception; so every value a reader returns can be written back as strict JSON. Every
complete events line is validated (``validate_event``) by both ``read_events`` and the live
``EventTail``; a torn last line (a killed run) is ignored. This module imports no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import reprlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrepro._io import atomic_write_json
from torchrepro._jsonread import is_text, loads, read_json
from torchrepro.errors import EnvFileError, LaunchError, SettingsError
from torchrepro.events import EVENT_KINDS

__all__ = [
    "CHECKS_ROOT",
    "COMMAND_FILE",
    "ENV_FILE",
    "LOCK_FILE",
    "RECORDS_ROOT",
    "RUNS_ROOT",
    "SETTINGS_FILE",
    "STDERR_FILE",
    "STDOUT_FILE",
    "TRACE_PREFIX",
    "VERDICT_FILE",
    "EventTail",
    "RunRecord",
    "RunSettings",
    "capture_paths",
    "claim",
    "compiled_count",
    "compiled_path",
    "events_path",
    "killpoint_path",
    "killpoints",
    "load_run",
    "new_run_dir",
    "new_run_id",
    "ops_path",
    "ops_process_files",
    "ops_process_path",
    "process_files",
    "process_path",
    "ranks_present",
    "read_events",
    "read_json",
    "read_states",
    "read_uncovered",
    "read_world",
    "states_path",
    "trace_path",
    "trace_prefix",
    "validate_event",
    "write_compiled",
    "write_env",
    "write_run_files",
    "write_uncovered",
    "write_verdict",
    "write_world",
]

COMMAND_FILE = "command.json"
SETTINGS_FILE = "settings.json"
ENV_FILE = "env.json"
VERDICT_FILE = "verdict.json"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
TRACE_PREFIX = "trace-step"
"""Op traces in a run record are ``<TRACE_PREFIX><step>.rank<R>``."""
WRITES_FILE = "writes.jsonl"
"""In a check's run record: the paths the run's script wrote, one JSON line each (``_child.writes``)."""
FILES_DIR = "files"
"""In an isolated run's record: what the run wrote below the working directory (``isolation``)."""
FILES_DELETED = "files.deleted"
"""In an isolated run's record: paths below the working directory the run deleted, one a line."""
LOCK_FILE = ".torchrepro-lock"
"""Held (``flock``) by the run writing a record directory; ignored when a directory is checked."""

_MAX_INDEX = 2**63 - 1
"""The largest step or tensor dimension an event may name (an int64, like torch's)."""

_EVENTS_RE = re.compile(r"^events\.rank(\d+)\.jsonl$")
_TRACE_RE = re.compile(r"^" + re.escape(TRACE_PREFIX) + r"(\d+)\.rank(\d+)$")
_OPS_GLOB = "*.rank*.json"
_WORLD_RE = re.compile(r"^world\.rank(\d+)\.json$")
_NODE_ENV_RE = re.compile(r"^env\.node(\d+)\.json$")
_UNCOVERED_RE = re.compile(r"^uncovered\.pid(\d+)\.json$")
_KILLPOINT_RE = re.compile(r"^killpoint\.rank(\d+)\.json$")


def new_run_id() -> str:
    """A run id unique across processes and machines: UTC time, pid and 48 random bits.

    It draws from ``os.urandom``, never from an RNG a script could have seeded.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{stamp}-{os.getpid()}-{os.urandom(6).hex()}"


RECORDS_GITIGNORE = "# torchrepro's run and check records (torchrepro clean removes old ones)\n*\n"


RECORDS_ROOT = ".torchrepro"
"""Where torchrepro keeps its records, below the working directory: ``runs/`` and ``checks/``."""
RUNS_ROOT = os.path.join(RECORDS_ROOT, "runs")
CHECKS_ROOT = os.path.join(RECORDS_ROOT, "checks")


def _ignore_records(base: Path) -> None:
    """Give the ``.torchrepro`` directory above ``base`` a ``.gitignore`` of everything, once (a
    file already there is the user's and left as it is)."""
    for directory in (base, *base.parents):
        if directory.name == RECORDS_ROOT:
            with contextlib.suppress(OSError), open(directory / ".gitignore", "x", encoding="utf-8") as f:
                f.write(RECORDS_GITIGNORE)
            return


_RUN_ID_RE = re.compile(r"\d{8}-\d{6}-\d+-[0-9a-f]{12}")  # what new_run_id() makes


def new_run_dir(root: str | os.PathLike[str] = RUNS_ROOT) -> Path:
    """Create and return a fresh run directory under ``root`` (never an existing one)."""
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    _ignore_records(base)
    for _ in range(100):
        path = base / new_run_id()
        try:
            path.mkdir()
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
        return path
    raise LaunchError(f"could not create a unique run directory under {base}")  # pragma: no cover


def is_events_file(name: str) -> bool:
    """Whether ``name`` is a rank's events file (``events.rank<R>.jsonl``)."""
    return _EVENTS_RE.match(name) is not None


def node_stderr_name(node: int) -> str:
    """In a check across nodes, a run record's copy of node ``node``'s stderr of that run."""
    return f"stderr.node{node}.log"


def events_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """The events file of ``rank`` in the run record ``run_dir``."""
    return Path(run_dir) / f"events.rank{rank}.jsonl"


def varied_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where ``rank`` lists the DataLoaders ``--vary workers`` changed: ``[[from, to], ...]``."""
    return Path(run_dir) / f"varied.rank{rank}.json"


def write_varied(run_dir: str | os.PathLike[str], rank: int, changes: Sequence[tuple[int, int]]) -> None:
    """Write the ``num_workers`` changes ``--vary workers`` made in ``rank`` (one per DataLoader)."""
    atomic_write_json(varied_path(run_dir, rank), [list(change) for change in changes])


def read_varied(run_dir: str | os.PathLike[str], rank: int) -> list[tuple[int, int]] | None:
    """The changes ``write_varied`` wrote for ``rank`` (``None`` when there is no such file);
    ``EnvFileError`` naming the file when it is malformed."""
    path = varied_path(run_dir, rank)
    if not path.exists():
        return None
    data = read_json(path)
    if not isinstance(data, list) or not all(
        isinstance(c, list) and len(c) == 2 and all(type(n) is int and n >= 0 for n in c) for c in data
    ):
        what = "a list of [from, to] worker counts"
        raise EnvFileError(f"cannot read {path}: expected {what}, got {_show(data)}")
    return [(c[0], c[1]) for c in data]


def write_world(
    run_dir: str | os.PathLike[str],
    rank: int,
    world_size: int,
    *,
    node: int | None = None,
    host: str | None = None,
) -> None:
    """Note that ``rank`` joined a process group of ``world_size`` ranks (``world.rank<R>.json``),
    on node ``node`` (torchrun's ``GROUP_RANK``) of host ``host`` when the run spans nodes."""
    note: dict[str, Any] = {"rank": rank, "world_size": world_size}
    if node is not None:
        note.update(node=node, host=host)
    atomic_write_json(Path(run_dir) / f"world.rank{rank}.json", note)


def _notes(run_dir: str | os.PathLike[str], pattern: re.Pattern[str]) -> Iterator[tuple[int, Any]]:
    """``(number, content)`` of every JSON note in ``run_dir`` whose name ``pattern`` matches (its
    group 1 is the number); unreadable notes skipped: a torn note must not hide the others."""
    try:
        names = sorted(p.name for p in Path(run_dir).iterdir())
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        if m:
            try:
                yield int(m.group(1)), read_json(Path(run_dir) / name)
            except EnvFileError:
                continue


def read_nodes(run_dir: str | os.PathLike[str]) -> dict[int, tuple[int, str]]:
    """``{rank: (node, host)}`` of the ranks whose world note names a node (a multi-node run)."""
    found: dict[int, tuple[int, str]] = {}
    for rank, data in _notes(run_dir, _WORLD_RE):
        node = data.get("node") if isinstance(data, dict) else None
        if type(node) is int and node >= 0:
            found[rank] = (node, str(data.get("host") or "?"))
    return found


def node_env_path(run_dir: str | os.PathLike[str], node: int) -> Path:
    """The environment of node ``node`` of a multi-node run (written by its local rank 0)."""
    return Path(run_dir) / f"env.node{node}.json"


def read_node_envs(run_dir: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """``{node: environment}`` of every node environment in ``run_dir`` (unreadable ones skipped)."""
    found = [(node, data) for node, data in _notes(run_dir, _NODE_ENV_RE) if isinstance(data, dict)]
    return dict(sorted(found))


def read_world(run_dir: str | os.PathLike[str]) -> dict[int, int]:
    """``{rank: world size}`` of every ``write_world`` note in ``run_dir`` (malformed ones skipped:
    a torn note must not hide the ranks the others name)."""
    found: dict[int, int] = {}
    for rank, data in _notes(run_dir, _WORLD_RE):
        size = data.get("world_size") if isinstance(data, dict) else None
        if type(size) is int and 0 < size <= 1 << 20:
            found[rank] = size
    return found


def ranks_present(run_dir: str | os.PathLike[str]) -> set[int]:
    """The ranks ``run_dir`` shows to exist: those with an events file, and every rank of the
    world sizes ``write_world`` noted (a rank that joined a process group but recorded nothing)."""
    try:
        names = [p.name for p in Path(run_dir).iterdir()]
    except OSError:
        return set()
    found = {int(m.group(1)) for m in map(_EVENTS_RE.match, names) if m}
    if any(_WORLD_RE.match(name) for name in names):
        found.update(range(max(read_world(run_dir).values(), default=0)))
    return found


def states_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """The step states of ``rank`` (``check --vary resume``), one JSON object a line."""
    return Path(run_dir) / f"states.rank{rank}.jsonl"


def _state_problem(state: Any) -> str | None:
    if not isinstance(state, dict) or not _is_index(state.get("step")):
        return "expected an object with a step index"
    rng = state.get("rng")
    if not isinstance(rng, dict) or not all(isinstance(v, str) for v in rng.values()):
        return "expected 'rng': an object of fingerprints"
    leaves = state.get("t", [])
    if not isinstance(leaves, list) or not all(
        isinstance(e, dict) and isinstance(e.get("n"), str) and isinstance(e.get("fp"), str) for e in leaves
    ):
        return "expected 't': a list of {n, fp} objects"
    return None


def read_states(run_dir: str | os.PathLike[str], rank: int) -> list[dict[str, Any]]:
    """The step states ``rank`` noted, in order (none: ``[]``); a torn last line (a killed run) is
    ignored, anything else malformed is an ``EnvFileError`` naming the file and line."""
    path = states_path(run_dir, rank)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise EnvFileError(f"cannot read {path}: {exc}") from None
    lines = data.split(b"\n")
    states: list[dict[str, Any]] = []
    for number, raw in enumerate(lines[:-1], start=1):  # the part after the last newline is torn
        if not raw.strip():
            continue
        try:
            state = loads(raw)
        except ValueError:
            state = None
        problem = _state_problem(state)
        if problem is not None:
            raise EnvFileError(f"cannot read {path}, line {number}: {problem}")
        states.append(state)
    return states


def compiled_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """How many graphs ``rank`` of a compiled run (``check --vary compile``) had Dynamo compile."""
    return Path(run_dir) / f"compiled.rank{rank}.json"


def write_compiled(run_dir: str | os.PathLike[str], rank: int, compiles: int) -> None:
    """Note that ``rank`` has finished ``compiles`` compilations so far."""
    atomic_write_json(compiled_path(run_dir, rank), {"compiles": compiles})


def compiled_count(run_dir: str | os.PathLike[str]) -> int:
    """The compilations every rank of ``run_dir`` noted, together (0: none noted, or unreadable)."""
    total = 0
    try:
        paths = sorted(Path(run_dir).glob("compiled.rank*.json"))
    except OSError:
        return 0
    for path in paths:
        try:
            data = read_json(path)
        except EnvFileError:
            continue
        count = data.get("compiles") if isinstance(data, dict) else None
        if type(count) is int and count > 0:
            total += count
    return total


def killpoint_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where ``rank`` notes that it waits, before the step it is killed at, to be killed."""
    return Path(run_dir) / f"killpoint.rank{rank}.json"


def killpoints(run_dir: str | os.PathLike[str]) -> set[int]:
    """The ranks of ``run_dir`` that reached their kill point."""
    try:
        names = [p.name for p in Path(run_dir).iterdir()]
    except OSError:
        return set()
    return {int(m.group(1)) for m in map(_KILLPOINT_RE.match, names) if m}


def write_uncovered(run_dir: str | os.PathLike[str], pid: int, argv: Sequence[str], reason: str) -> None:
    """Note a python child whose events could not be recorded (``uncovered.pid<P>.json``)."""
    atomic_write_json(Path(run_dir) / f"uncovered.pid{pid}.json", {"argv": list(argv), "reason": reason})


def read_uncovered(run_dir: str | os.PathLike[str]) -> list[str]:
    """One line per ``write_uncovered`` note in ``run_dir``: the child's command and why."""
    lines: list[str] = []
    try:
        names = sorted(p.name for p in Path(run_dir).iterdir())
    except OSError:
        return lines
    for name in names:
        if not _UNCOVERED_RE.match(name):
            continue
        try:
            data = read_json(Path(run_dir) / name)
        except EnvFileError:
            data = None
        if not isinstance(data, dict):
            lines.append(f"a python child ({name}) was not recorded")
            continue
        argv = data.get("argv")
        command = " ".join(["python", *map(str, argv[1:])]) if isinstance(argv, list) else "python ?"
        command = command if len(command) <= 160 else command[:157] + "..."
        lines.append(f"python child `{command}` was not recorded: {data.get('reason')}")
    return lines


def trace_prefix(run_dir: str | os.PathLike[str], step: int) -> Path:
    """Where a run traces step ``step``: each rank writes ``trace_path(<this>, rank)``."""
    return Path(run_dir).resolve() / f"{TRACE_PREFIX}{step}"


def trace_path(prefix: str | os.PathLike[str], rank: int) -> Path:
    """The op trace file of ``rank`` for a trace prefix (``trace_prefix`` or a check's own)."""
    return Path(f"{os.fspath(prefix)}.rank{rank}")


def capture_paths(prefix: str | os.PathLike[str], rank: int) -> tuple[Path, Path]:
    """The op call ``rank`` captured for ``check --repro`` under a capture prefix: its tensors
    (``.pt``, loadable with ``torch.load(weights_only=True)``) and the call described (``.json``)."""
    base = f"{os.fspath(prefix)}.rank{rank}"
    return Path(base + ".pt"), Path(base + ".json")


def ops_path(prefix: str | os.PathLike[str], rank: int) -> Path:
    """The audit's op recording of ``rank`` for an ops prefix."""
    return Path(f"{os.fspath(prefix)}.rank{rank}.json")


def ops_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Every op recording (``ops_path``) in ``directory``, in rank order of their names."""
    return sorted(Path(directory).glob(_OPS_GLOB))


def ops_process_path(prefix: str | os.PathLike[str], pid: int) -> Path:
    """The audit's op recording of a python child (process ``pid``) that has no rank of its own."""
    return Path(f"{os.fspath(prefix)}.pid{pid}.json")


def ops_process_files(prefix: str | os.PathLike[str]) -> list[Path]:
    """Every ``ops_process_path(prefix, pid)`` that exists, in pid order."""
    base = Path(prefix)
    pattern = re.compile(r"^" + re.escape(base.name) + r"\.pid(\d+)\.json$")
    return _by_pid(base.parent, pattern)


def process_path(path: str | os.PathLike[str], pid: int) -> Path:
    """The file a child process (``pid``) writes where the process torchrepro started writes
    ``path`` (the audit's probe record: ``probe.json`` -> ``probe.pid<P>.json``)."""
    base = Path(path)
    return base.with_name(f"{base.stem}.pid{pid}{base.suffix}")


def process_files(path: str | os.PathLike[str]) -> list[Path]:
    """Every ``process_path(path, pid)`` that exists, in pid order."""
    base = Path(path)
    pattern = re.compile(r"^" + re.escape(base.stem) + r"\.pid(\d+)" + re.escape(base.suffix) + r"$")
    return _by_pid(base.parent, pattern)


def _by_pid(directory: Path, pattern: re.Pattern[str]) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := pattern.match(p.name))]
    return [p for _, p in sorted(found)]


def _is_record_file(name: str) -> bool:
    fixed = (COMMAND_FILE, SETTINGS_FILE, ENV_FILE, VERDICT_FILE, STDOUT_FILE, STDERR_FILE)
    patterns = (_EVENTS_RE, _TRACE_RE, _WORLD_RE, _UNCOVERED_RE, _NODE_ENV_RE)
    return name in fixed or any(p.match(name) for p in patterns)


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
    ``portable``: started in portable mode (``torchrepro.portable``: oneDNN off in the child), with
    ``MKL_CBWR`` and ``ATEN_CPU_CAPABILITY`` as the child's environment held them. ``nnodes``: the
    ranks spanned that many nodes (``nproc`` per node), ``node_rank``: this node's ``--node-rank``.
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
    portable: bool | None = None
    MKL_CBWR: str | None = None
    ATEN_CPU_CAPABILITY: str | None = None
    nnodes: int | None = None
    node_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunSettings:
        """Read ``settings.json``: unknown keys ignored, a value of the wrong type read as unset."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = d.get(f.name)
            if "bool" in str(f.type):
                if isinstance(value, bool):
                    values[f.name] = value
                continue
            want = int if "int" in str(f.type) else str
            if isinstance(value, want) and not isinstance(value, bool):
                values[f.name] = value
        return cls(**values)


def write_run_files(run_dir: str | os.PathLike[str], command: Sequence[str], settings: RunSettings) -> None:
    """Write ``command.json`` and ``settings.json`` of a run record."""
    root = Path(run_dir)
    atomic_write_json(root / COMMAND_FILE, {"argv": list(command), "cwd": os.getcwd()})
    atomic_write_json(root / SETTINGS_FILE, settings.to_dict())


def write_env(run_dir: str | os.PathLike[str], env: Mapping[str, Any], *, node: int | None = None) -> None:
    """Write ``env.json`` of a run record (``node``: that node's ``env.node<N>.json`` in a multi-node
    run)."""
    path = Path(run_dir) / ENV_FILE if node is None else node_env_path(run_dir, node)
    atomic_write_json(path, dict(env))


def write_verdict(check_dir: str | os.PathLike[str], verdict: Mapping[str, Any]) -> None:
    """Write a check's ``verdict.json``."""
    atomic_write_json(Path(check_dir) / VERDICT_FILE, dict(verdict))


def _read_object(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    data = read_json(path)
    return data if isinstance(data, dict) else None


def _show(value: Any) -> str:
    """A short one-line description of a bad value: its JSON type and a truncated repr."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    kind = names.get(type(value), "number")
    return f"{kind} {reprlib.repr(value)}"


def _is_index(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _MAX_INDEX


def _event_problem(event: Any) -> str | None:
    """What is wrong with one parsed events line (None: a well-formed event)."""
    if not isinstance(event, dict):
        return f"an event must be a JSON object, got {_show(event)}"
    for name in ("kind", "key", "step", "fp", "t"):
        if name not in event:
            return f"the event has no {name!r} field"
    kind, step = event["kind"], event["step"]
    if not isinstance(kind, str) or kind not in EVENT_KINDS:
        return f"'kind' must be one of {', '.join(EVENT_KINDS)}, got {_show(kind)}"
    for name in ("key", "fp"):
        if not is_text(event[name]):
            return f"{name!r} must be a string of Unicode text, got {_show(event[name])}"
    if not _is_index(step):
        return f"'step' must be an integer from 0 to 2**63-1, got {_show(step)}"
    leaves = event["t"]
    if not isinstance(leaves, list):
        return f"'t' must be an array of tensor entries, got {_show(leaves)}"
    for i, leaf in enumerate(leaves):
        problem = _leaf_problem(leaf)
        if problem is not None:
            return f"t[{i}]: {problem}"
    return None


def _leaf_problem(leaf: Any) -> str | None:
    if not isinstance(leaf, dict):
        return f"a tensor entry must be a JSON object, got {_show(leaf)}"
    for name in ("fp", "dtype", "shape"):
        if name not in leaf:
            return f"the tensor entry has no {name!r} field"
    for name in ("fp", "dtype"):
        if not is_text(leaf[name]):
            return f"{name!r} must be a string of Unicode text, got {_show(leaf[name])}"
    shape = leaf["shape"]
    if not isinstance(shape, list) or not all(_is_index(n) for n in shape):
        return f"'shape' must be an array of integers from 0 to 2**63-1, got {_show(shape)}"
    if "v" in leaf:
        values = leaf["v"]
        if not isinstance(values, list):
            return f"'v' must be an array of numbers, got {_show(values)}"
        for j, x in enumerate(values):
            if type(x) is float:
                continue
            if type(x) is not int:
                return f"'v' must be an array of numbers, got {_show(x)} at v[{j}]"
            try:
                float(x)
            except OverflowError:
                return f"'v' must be an array of numbers, got an integer too large for a float at v[{j}]"
    return None


def validate_event(event: Any, *, path: str | os.PathLike[str], line: int) -> dict[str, Any]:
    """``event`` (one parsed events line) if it is well formed; else ``EnvFileError`` naming the file,
    the 1-based ``line`` and what is wrong.

    A well-formed event is an object with ``kind`` (one of ``EVENT_KINDS``), ``key`` (a string),
    ``step`` (an integer >= 0, not a boolean), ``fp`` (a string) and ``t``: an array of objects
    with ``fp`` and ``dtype`` (strings), ``shape`` (integers >= 0) and optionally ``v`` (numbers,
    NaN and infinities included). Other fields are kept and never read.
    """
    problem = _event_problem(event)
    if problem is not None:
        raise EnvFileError(f"cannot read events file {os.fspath(path)}, line {line}: {problem}")
    assert isinstance(event, dict)
    return event


def _parse_event(raw: bytes, *, path: str | os.PathLike[str], line: int) -> dict[str, Any]:
    try:
        event = loads(raw)  # recorded values may be NaN or infinite; validate_event checks the rest
    except ValueError as exc:
        raise EnvFileError(f"cannot read events file {os.fspath(path)}, line {line}: {exc}") from None
    return validate_event(event, path=path, line=line)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete event in an events file (a torn last line from a crash is ignored).

    Lines holding only whitespace are skipped. ``EnvFileError`` naming the file (and the
    1-based line) when it is unreadable or a complete line is not a well-formed event
    (``validate_event``).
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise EnvFileError(f"cannot read events file {os.fspath(path)}: {exc}") from None
    lines = data.split(b"\n")
    lines.pop()  # after the last newline: empty, or a torn line still being written
    return [_parse_event(raw, path=path, line=n) for n, raw in enumerate(lines, start=1) if raw.strip()]


class EventTail:
    """Reads the complete events appended to a (possibly still growing) events file.

    A malformed complete line raises ``EnvFileError`` (file, line, what is wrong), like
    ``read_events``; the error is sticky: later polls raise it again until the file is rewritten.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""
        self._lines = 0
        self._error: EnvFileError | None = None

    def poll(self) -> int:
        """Read newly completed lines; return how many events were added."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:  # rewritten (the process re-executed itself)
                    self.events.clear()
                    self._offset = 0
                    self._partial = b""
                    self._lines = 0
                    self._error = None
                if self._error is not None:
                    raise EnvFileError(str(self._error))
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise EnvFileError(f"cannot read events file {self.path}: {exc}") from None
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        added = 0
        for raw in lines:
            self._lines += 1
            if not raw.strip():
                continue
            try:
                self.events.append(_parse_event(raw, path=self.path, line=self._lines))
            except EnvFileError as exc:
                self._error = exc
                raise
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
    try:
        entries = sorted(root.iterdir())
    except OSError as exc:
        raise EnvFileError(f"cannot read run record {os.fspath(path)!r}: {exc}") from None
    for entry in entries:
        t = _TRACE_RE.match(entry.name)
        if t:
            traces.setdefault(int(t.group(1)), {})[int(t.group(2))] = os.fspath(entry)
        m = _EVENTS_RE.match(entry.name)
        if m:
            events[int(m.group(1))] = read_events(entry)
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


# --------------------------------------------------------------------------- cleaning up

RECORD_KINDS = ("runs", "checks")
"""The record directories below ``.torchrepro``: ``torchrepro run``'s and ``check``'s."""


@dataclass(frozen=True)
class CleanReport:
    """What ``clean_records`` removed (or would, with ``dry_run``) and what it left."""

    removed: tuple[str, ...]
    kept: tuple[str, ...]
    in_use: tuple[str, ...]  # records a run is writing (or made in the last minute): never removed
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "removed": list(self.removed),
            "kept": list(self.kept),
            "in_use": list(self.in_use),
            "dry_run": self.dry_run,
        }


def _in_use(record: Path, now: float) -> bool:
    """Whether a run holds a lock in ``record`` (or its ``run<i>/``), or it changed a minute ago."""
    try:
        if now - record.stat().st_mtime < 60:
            return True
        locks = [record / LOCK_FILE, *record.glob(f"*/{LOCK_FILE}")]
    except OSError:
        return True
    for lock in locks:
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def clean_records(
    root: str | os.PathLike[str] = RECORDS_ROOT, *, keep: int = 10, dry_run: bool = False
) -> CleanReport:
    """Remove all but the ``keep`` newest records of each kind (``runs/``, ``checks/``) below
    ``root``; a record a run is writing, or one changed in the last minute, is never removed.

    Records are ordered by their names (a UTC time stamp first, see ``new_run_id``). Only
    directories named like records are considered; anything else below ``root`` is left alone.
    """
    import shutil

    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise SettingsError(f"keep must be an int >= 0 (records kept of each kind), got {keep!r}")
    base = Path(root)
    removed: list[str] = []
    kept: list[str] = []
    in_use: list[str] = []
    now = time.time()
    for kind in RECORD_KINDS:
        directory = base / kind
        if not directory.is_dir():
            continue
        records = sorted(p for p in directory.iterdir() if p.is_dir() and _RUN_ID_RE.fullmatch(p.name))
        old = records[: max(len(records) - keep, 0)]
        kept += [str(p) for p in records[len(old) :]]
        for record in old:
            if _in_use(record, now):
                in_use.append(str(record))
                continue
            if not dry_run:
                shutil.rmtree(record, ignore_errors=True)
            removed.append(str(record))
    return CleanReport(tuple(removed), tuple(kept), tuple(in_use), dry_run)
