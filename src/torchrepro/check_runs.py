"""The runs of a check: each run's processes, record tails and layers, started and compared live.

Invariants:
- A run starts under the supervisor (``launch.spawn``), in its write-isolation overlay when the
  check has one, with OpenMP threads that wait passively (the runs share the cores; no result
  changes); ``Run.stop`` ends its whole process tree and then moves its writes into its record.
- ``watch`` compares every later run against the first, event by event as the events arrive,
  rank by rank (ranks the script starts itself are discovered from the records; ``pair`` says
  which events of the first run a rank of a later run is compared with), and returns the
  divergences in the one order ``events.in_order`` gives; with ``stop_early`` it stops at the
  first; with ``serial`` it starts one run at a time.
- A run that fails is reported as the first failed run in run order, never as a divergence.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from torchrepro import runrecord
from torchrepro._child.overlay import Overlay
from torchrepro.compare.alignment import RankCursor, world_cursor
from torchrepro.errors import ReproError
from torchrepro.events import in_order, is_step
from torchrepro.isolation import Layers
from torchrepro.launch import kill_tree, signals_held, spawn
from torchrepro.protocol import ChildSpec
from torchrepro.results import Divergence
from torchrepro.runrecord import EventTail


class Relay(Protocol):
    """What a run spanning nodes needs of the other nodes (``check_nodes.Relay``)."""

    @property
    def nnodes(self) -> int: ...

    def start(self, run: Run) -> list[str]: ...

    def poll(self, run: Run, local: int | None) -> int | None: ...

    def stop(self, run: Run, *, kill_local: Any) -> None: ...


__all__ = [
    "CheckProgress",
    "Pair",
    "Relay",
    "Run",
    "discover_ranks",
    "make_run",
    "rank_notes",
    "relayed",
    "same_rank",
    "varied_workers",
    "watch",
    "world_pair",
]


@dataclass(frozen=True)
class CheckProgress:
    """A progress report: optimizer steps each run has completed (on rank 0), and the phase."""

    phase: str
    steps: tuple[int, ...]


@dataclass
class Run:
    index: int
    record_dir: Path
    command: list[str]
    env: dict[str, str]
    ranks: int
    overlay: Overlay | None = None
    layers: Layers | None = None
    proc: subprocess.Popen[bytes] | None = None
    tails: list[EventTail] = field(default_factory=list)
    stdout: IO[bytes] | None = None
    stderr: IO[bytes] | None = None
    returncode: int | None = None
    spec: ChildSpec | None = None
    # across nodes (check_nodes): the other nodes start, stop and forward their part of the run;
    # failure says how it failed when that is more than its exit code here (a node named)
    relay: Relay | None = None
    launch: int | None = None
    failure: str | None = None
    failed_nodes: tuple[int, ...] = ()

    def start(self) -> None:
        if self.relay is not None:
            self.command = self.relay.start(self)
        self.record_dir.mkdir(parents=True, exist_ok=True)
        self.stdout = open(self.record_dir / runrecord.STDOUT_FILE, "wb")  # noqa: SIM115
        self.stderr = open(self.record_dir / runrecord.STDERR_FILE, "wb")  # noqa: SIM115
        with signals_held():  # a SIGTERM or Ctrl-C comes once self.proc is set, so stop() ends it
            self.proc = spawn(
                self.command,
                env=self.env,
                new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=self.stdout,
                stderr=self.stderr,
                overlay=self.overlay,
            )

    def __post_init__(self) -> None:
        self.tails = [EventTail(runrecord.events_path(self.record_dir, r)) for r in range(self.ranks)]

    def discover(self) -> int:
        """The ranks this run has shown so far (the script may start ranks itself)."""
        return max(self.ranks, max(runrecord.ranks_present(self.record_dir), default=-1) + 1)

    def add_ranks(self, ranks: int) -> None:
        """Follow the events of ranks up to ``ranks`` (files that may not exist yet)."""
        while len(self.tails) < ranks:
            self.tails.append(EventTail(runrecord.events_path(self.record_dir, len(self.tails))))
        self.ranks = max(self.ranks, ranks)

    def poll(self) -> bool:
        """Read new events; True once the process has exited (events then complete)."""
        if self.proc is None:  # not started yet (--serial)
            return False
        if self.returncode is None:
            local = self.proc.poll()
            self.returncode = local if self.relay is None else self.relay.poll(self, local)
        for tail in self.tails:
            tail.poll()
        return self.returncode is not None

    def stop(self) -> None:
        if self.relay is not None:
            self.relay.stop(self, kill_local=self._kill)
        else:
            self._kill()
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        if self.layers is not None:  # every process of the run has ended: its overlay is gone
            self.layers.collect(self.record_dir)
            self.layers = None

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()
        elif self.proc is not None:
            kill_tree(self.proc.pid)  # leftovers, e.g. DataLoader workers of a finished rank

    def steps_done(self) -> int:
        if not self.tails:
            return 0
        events = self.tails[0].events
        optimizer = sum(1 for e in events if is_step(e["kind"], e["key"]))
        # steps no optimizer sees: two events each (gradients, then the parameters after the update)
        return optimizer or sum(1 for e in events if is_step(e["kind"], e["key"], backward=True)) // 2

    def stderr_tail(self, lines: int = 25) -> str:
        """The end of the run's stderr (across nodes: of each node whose part failed, headed)."""
        if not self.failed_nodes:
            return self._tail(runrecord.STDERR_FILE, lines)
        tails = []
        for n in self.failed_nodes:
            name = runrecord.STDERR_FILE if n == 0 else runrecord.node_stderr_name(n)
            tails.append(f"--- node {n}'s stderr, last lines ---\n" + self._tail(name, lines))
        return "\n".join(tails)

    def _tail(self, name: str, lines: int) -> str:
        try:
            text = (self.record_dir / name).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        rows = text.rstrip().splitlines()
        start = max(0, len(rows) - lines)
        for i in range(len(rows) - 1, -1, -1):  # show the whole last traceback when it fits
            if rows[i].startswith("Traceback ("):
                if len(rows) - i <= 60:
                    start = min(start, i)
                break
        return "\n".join(rows[start:])


_OMP_WAIT = "OMP_WAIT_POLICY"

_RELAY: ContextVar[Relay | None] = ContextVar("torchrepro_relay", default=None)


@contextlib.contextmanager
def relayed(relay: Relay) -> Iterator[None]:
    """Every run ``make_run`` makes in the block spans the nodes of ``relay`` (``check_nodes``)."""
    token = _RELAY.set(relay)
    try:
        yield
    finally:
        _RELAY.reset(token)


def varied_workers(run: Run, ranks: int) -> tuple[str, str | None, str | None]:
    """What ``--vary workers`` changed in ``run``: a note, the change in a few words (``num_workers
    2 vs 0 in 1 DataLoader``; None when nothing was varied) and, then, why nothing was."""
    changes: Counter[tuple[int, int]] = Counter()
    for rank in range(ranks):
        try:
            found = runrecord.read_varied(run.record_dir, rank)
        except ReproError as exc:
            return f"--vary workers: what was varied is unknown ({exc})", None, f"--vary workers: {exc}"
        changes.update(found or [])
    if not changes:
        note = f"--vary workers: run {run.index + 1} created no DataLoader; nothing was varied"
        return note, None, "--vary workers varied nothing: the script created no DataLoader"
    total = sum(changes.values())
    parts = [(f"{a} -> {b}", f"{a} vs {b}", n) for (a, b), n in sorted(changes.items())]
    loaders = f"{total} DataLoader{'s' if total != 1 else ''}"
    note = ", ".join(arrow + (f" in {n}" if len(changes) > 1 else "") for arrow, _, n in parts)
    text = ", ".join(versus + (f" in {n}" if len(changes) > 1 else "") for _, versus, n in parts)
    return (
        f"--vary workers: num_workers {note} in {loaders} (run {run.index + 1})",
        f"num_workers {text} {'of' if len(changes) > 1 else 'in'} {loaders}",
        None,
    )


def make_run(
    index: int,
    record_dir: Path,
    command: list[str],
    spec: ChildSpec,
    *,
    ranks: int,
    layers: Layers | None = None,
    overlay: Overlay | None = None,
) -> Run:
    """A run recorded in ``record_dir``, not started; in a fresh layer of ``layers``, or in
    ``overlay`` (a layer handed over from a run that ended: ``Layers.hand_over``)."""
    spec = spec.replace(record_dir=os.fspath(record_dir.resolve()))
    relay = _RELAY.get()
    if relay is not None:  # the other nodes forward their ranks' records (check_nodes), none ships
        spec = spec.replace(nnodes=relay.nnodes, relayed=True)
    if overlay is None and layers is not None:
        overlay = layers.overlay(record_dir)
    env = spec.to_env()
    # The runs of a check share the cores. OpenMP threads that wait by spinning (the default)
    # then burn the cores the other run needs: a check of a short CPU script took 2-2.5x one
    # run instead of ~1.2x. Passive waiting changes neither the thread count nor how work is
    # split, so no result changes; a policy the user set is kept.
    env.setdefault(_OMP_WAIT, "PASSIVE")
    return Run(
        index=index,
        record_dir=record_dir,
        command=command,
        env=env,
        ranks=ranks,
        overlay=overlay,
        layers=layers,
        spec=spec,
        relay=relay,
    )


Pair = Callable[["Run", "Run", int], RankCursor]
"""How rank ``r`` of a later run is compared with the first run: ``(first, later, r) -> cursor``."""


def same_rank(first: Run, run: Run, r: int) -> RankCursor:
    """Rank ``r`` against rank ``r``, every event (runs on the same number of processes)."""
    return RankCursor(r, first.tails[r].events, run.tails[r].events)


def world_pair(first: Run, run: Run, r: int) -> RankCursor:
    """Rank ``r`` of a run on more processes against rank 0 of the first run, in the events that
    must not depend on the world size (``check --vary world``; ``compare.WorldScope``)."""
    return world_cursor(r, first.tails[0].events, run.tails[r].events)


def discover_ranks(
    runs: list[Run], cursors: dict[tuple[int, int], RankCursor], pair: Pair = same_rank
) -> None:
    """Compare the ranks a script started itself too, once any run shows them."""
    ranks = max(run.discover() for run in runs)
    first = runs[0]
    for run in runs:
        run.add_ranks(ranks)
    for run in runs[1:]:
        for r in range(ranks):
            if (run.index, r) not in cursors:
                cursors[(run.index, r)] = pair(first, run, r)


def rank_notes(runs: list[Run], nproc: int | None) -> list[str]:
    """Why ranks the script started itself, or python children it started, were not compared."""
    notes: list[str] = []
    started = max(run.ranks for run in runs)
    for r in range(nproc or 1, started):
        ended: list[str] = []
        stopped: list[str] = []  # runs the check stopped (at a divergence): r may not have begun
        for run in runs:
            if not runrecord.events_path(run.record_dir, r).exists():
                (ended if run.returncode is not None else stopped).append(str(run.index + 1))
        if ended:
            notes.append(
                f"rank {r} (started by the script) wrote no record in run(s) {', '.join(ended)}: it "
                "joined the process group but was not a python process torchrepro could configure "
                "(e.g. a forked process), or it ended first"
            )
        if stopped:
            notes.append(
                f"rank {r} (started by the script) had written no record when the check stopped "
                f"run(s) {', '.join(stopped)}, so it was not compared (a process torchrepro cannot "
                "configure, e.g. a forked one, never writes one)"
            )
    children: dict[str, list[int]] = {}
    for run in runs:
        for line in runrecord.read_uncovered(run.record_dir):
            indices = children.setdefault(line, [])
            if run.index + 1 not in indices:  # several processes of one run noting the same
                indices.append(run.index + 1)
    for line, indices in children.items():
        notes.append(f"run(s) {', '.join(map(str, indices))}: {line}")
    return notes


def watch(
    runs: list[Run],
    *,
    progress: Callable[[CheckProgress], None] | None,
    poll_interval: float,
    stop_early: bool = True,
    serial: bool = False,
    pair: Pair = same_rank,
    linger: int = 0,
) -> tuple[list[tuple[int, Divergence]], list[RankCursor], Run | None]:
    """Start the runs, compare live; return (divergences, cursors, failed run or None).

    ``linger``: with ``stop_early``, the runs go on for this many training steps after the step of
    the first divergence before they are stopped (so a report shows how the difference grows).

    ``serial``: one run at a time, each later one compared live against the first. ``pair``: how
    a rank of a later run is compared with the first run (``world_pair`` across world sizes).
    """
    for run in runs[:1] if serial else runs:
        run.start()
    first = runs[0]
    cursors: dict[tuple[int, int], RankCursor] = {}
    for run in runs[1:]:
        for r in range(run.ranks):
            cursors[(run.index, r)] = pair(first, run, r)
    found: dict[tuple[int, int], Divergence] = {}
    last_steps: tuple[int, ...] = ()
    failed: Run | None = None
    while True:
        discover_ranks(runs, cursors, pair)
        done = [run.poll() for run in runs]
        started = [r for r in runs if r.proc is not None]
        if serial and len(started) < len(runs) and all(r.returncode == 0 for r in started):
            runs[len(started)].start()  # the runs so far ended well: the next one, alone
            continue
        for run, is_done in zip(runs, done, strict=True):
            if is_done and run.returncode != 0 and failed is None:
                failed = run
        if failed is not None:  # several may have failed by now: report the first in run order
            time.sleep(poll_interval)
            failed = next(r for r in runs if r.poll() and r.returncode != 0)
        if failed is not None:
            break
        for (i, r), cursor in cursors.items():
            d = cursor.advance(a_done=done[0], b_done=done[i])
            if d is not None and (i, r) not in found:
                found[(i, r)] = d
        if found and stop_early:
            last = min(d.step for d in found.values()) + linger
            if linger == 0 or all(
                is_done or run.steps_done() > last for run, is_done in zip(runs, done, strict=True)
            ):
                break
        if all(done):
            break
        if progress is not None:
            steps = tuple(run.steps_done() for run in runs)
            if steps != last_steps:
                last_steps = steps
                progress(CheckProgress(phase="running", steps=steps))
        time.sleep(poll_interval)
    for run in runs:  # across nodes: the other nodes' events up to the stop are here once it stopped
        if run.relay is not None and run.proc is not None:
            run.stop()
    discover_ranks(runs, cursors, pair)
    for run in runs:  # events written up to the stop still count
        run.poll()
    for (i, r), cursor in cursors.items():
        d = cursor.advance()
        if d is not None and (i, r) not in found:
            found[(i, r)] = d
    divergences = in_order([(i, d) for (i, _), d in found.items()])  # the one rule compare uses too
    return divergences, list(cursors.values()), failed
