"""``torchrepro check``: run a script several times and report where the runs first part.

Invariants:
- All runs start together; every later run is compared live, event by event, against the first
  run, and at the first divergence every process is ended (early stop): a divergence at step 5
  of 500 costs about 5 steps, not two full runs.
- A run that fails (non-zero exit not caused by the check) makes the check a script failure,
  never a divergence; every process the check started is ended on return, on an exception,
  on Ctrl-C and on SIGTERM (process trees, torchrun ranks included).
- Each check writes only below its own fresh directory (``.torchrepro/checks/<id>/``): ``run<i>/``
  run records, ``locate<j>/`` trace re-runs, ``verdict.json``.
- The runs never write into the user's files: each run sees the working directory as the check
  found it plus its own writes, which end up in its record (``isolation``; off with
  ``isolate=False`` or where the kernel refuses, and then the verdict says so). Paths outside
  it that runs running at the same time both wrote are named (``shared_writes``); a run that
  failed after that is reported with them and the ways out, not as a plain script failure.
- ``serial`` runs one run at a time (each later run compared live against the complete first).
- The ranks compared are ``--nproc``'s and every rank a run's record shows (events files, the
  world sizes ranks noted when they joined a process group), so ranks the script starts itself
  are compared too; a rank that should exist but wrote no record, or a python child the script
  started that trained without a rank of its own, makes the verdict inconclusive with a note.
- A ``compute`` divergence at step k is located (op, module, line) by re-running both sides
  with op tracing for step k only; locating is best effort and never fails the check.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from torchrepro import runrecord
from torchrepro._child.overlay import Overlay
from torchrepro._child.spec import ChildSpec, python_hash_seed
from torchrepro.compare import (
    Coverage,
    Divergence,
    RankCursor,
    coverage,
    locate_in_traces,
    steps_compared,
)
from torchrepro.errors import ReproError, SettingsError
from torchrepro.events import in_order, is_step, optimizer_index
from torchrepro.isolation import Isolation, Layers, describe_shared, probe, shared_writes
from torchrepro.launch import (
    build_command,
    check_target,
    kill_tree,
    nproc_note,
    run_settings,
    spawn,
    terminate_on_signals,
)
from torchrepro.runrecord import EventTail

__all__ = ["VARY_CHOICES", "CheckProgress", "CheckResult", "check_script"]

VARY_CHOICES = ("workers", "threads", "hashseed")
"""What ``--vary`` can change in later runs."""

LOCATE_ATTEMPTS = 3


@dataclass(frozen=True)
class CheckProgress:
    """A progress report: optimizer steps each run has completed (on rank 0), and the phase."""

    phase: str
    steps: tuple[int, ...]


@dataclass(frozen=True)
class CheckResult:
    """The verdict of a check.

    ``reproducible`` is None when a run failed (``error`` says how, ``stderr_tail`` shows the
    end of its output) or when the check is inconclusive (no divergence, but nothing beyond
    ``init`` compared on some rank: ``coverage`` says what was); ``notes`` say what locating did
    or could not do, and why a check is inconclusive. ``isolation`` says how the runs' writes
    were kept apart; ``shared_writes`` are the paths runs running together both wrote anyway.
    """

    reproducible: bool | None
    runs: int
    steps_compared: int
    first_divergence: Divergence | None
    check_dir: str
    error: str | None = None
    returncode: int | None = None
    stderr_tail: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    coverage: Coverage | None = None
    isolation: Isolation | None = None
    shared_writes: tuple[str, ...] = ()

    @property
    def inconclusive(self) -> bool:
        """No divergence, but not enough was compared to call the script reproducible."""
        return self.reproducible is None and self.error is None

    def to_dict(self) -> dict[str, Any]:
        """The ``check --json`` object and ``verdict.json`` (``error`` only when a run failed)."""
        d: dict[str, Any] = {
            "reproducible": self.reproducible,
            "runs": self.runs,
            "steps_compared": self.steps_compared,
            "first_divergence": None if self.first_divergence is None else self.first_divergence.to_dict(),
            "inconclusive": self.inconclusive,
            "coverage": None if self.coverage is None else self.coverage.to_dict(),
            "notes": list(self.notes),
        }
        if self.isolation is not None:
            d["isolation"] = self.isolation.to_dict()
            d["shared_writes"] = list(self.shared_writes)
        if self.error is not None:
            d["error"] = self.error
        return d


@dataclass
class _Run:
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

    def start(self) -> None:
        self.record_dir.mkdir(parents=True, exist_ok=True)
        self.stdout = open(self.record_dir / runrecord.STDOUT_FILE, "wb")  # noqa: SIM115
        self.stderr = open(self.record_dir / runrecord.STDERR_FILE, "wb")  # noqa: SIM115
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
            self.returncode = self.proc.poll()
        for tail in self.tails:
            tail.poll()
        return self.returncode is not None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()
        elif self.proc is not None:
            kill_tree(self.proc.pid)  # leftovers, e.g. DataLoader workers of a finished rank
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        if self.layers is not None:  # every process of the run has ended: its overlay is gone
            self.layers.collect(self.record_dir)
            self.layers = None

    def steps_done(self) -> int:
        if not self.tails:
            return 0
        events = self.tails[0].events
        optimizer = sum(1 for e in events if is_step(e["kind"], e["key"]))
        # steps no optimizer sees: two events each (gradients, then the parameters after the update)
        return optimizer or sum(1 for e in events if is_step(e["kind"], e["key"], backward=True)) // 2

    def stderr_tail(self, lines: int = 25) -> str:
        try:
            text = (self.record_dir / runrecord.STDERR_FILE).read_text(encoding="utf-8", errors="replace")
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


def _run_spec(base: ChildSpec, vary: str | None, index: int, *, seed: int) -> ChildSpec:
    """The spec of run ``index``: ``base`` with what ``--vary`` changes in later runs."""
    if vary is None:
        return base
    if vary == "threads":
        first = base.threads or 1
        return base.replace(threads=first if index == 0 else (2 if first == 1 else 1))
    if vary == "hashseed":
        return base.replace(hash_seed=python_hash_seed(seed, "vary", index))
    if vary == "workers":
        return base.replace(num_workers="other") if index > 0 else base
    raise SettingsError(f"vary must be one of {VARY_CHOICES} or None, got {vary!r}")


_OMP_WAIT = "OMP_WAIT_POLICY"


def _varied_workers(run: _Run, ranks: int) -> tuple[str, bool]:
    """What ``--vary workers`` changed in ``run`` (a note), and whether it changed anything."""
    changes: Counter[tuple[int, int]] = Counter()
    for rank in range(ranks):
        try:
            found = runrecord.read_varied(run.record_dir, rank)
        except ReproError as exc:
            return f"--vary workers: what was varied is unknown ({exc})", False
        changes.update(found or [])
    if not changes:
        return f"--vary workers: run {run.index + 1} created no DataLoader; nothing was varied", False
    total = sum(changes.values())
    parts = ", ".join(
        f"{a} -> {b}" + (f" in {n}" if len(changes) > 1 else "") for (a, b), n in sorted(changes.items())
    )
    loaders = f"{total} DataLoader{'s' if total != 1 else ''}"
    return f"--vary workers: num_workers {parts} in {loaders} (run {run.index + 1})", True


def _varied_setting(specs: tuple[ChildSpec, ChildSpec]) -> str | None:
    """How ``--vary threads`` started the two located runs differently, in words (else None)."""
    a, b = specs
    if a.threads is None or b.threads is None or a.threads == b.threads:
        return None

    def threads(n: int) -> str:
        return f"{n} thread{'s' if n != 1 else ''}"

    return f"between {threads(a.threads)} (first run) and {threads(b.threads)} (other run)"


def _make_run(
    index: int,
    record_dir: Path,
    command: list[str],
    spec: ChildSpec,
    *,
    ranks: int,
    layers: Layers | None = None,
) -> _Run:
    spec = spec.replace(record_dir=os.fspath(record_dir.resolve()))
    overlay = None if layers is None else layers.overlay(record_dir)
    env = spec.to_env()
    # The runs of a check share the cores. OpenMP threads that wait by spinning (the default)
    # then burn the cores the other run needs: a check of a short CPU script took 2-2.5x one
    # run instead of ~1.2x. Passive waiting changes neither the thread count nor how work is
    # split, so no result changes; a policy the user set is kept.
    env.setdefault(_OMP_WAIT, "PASSIVE")
    return _Run(
        index=index,
        record_dir=record_dir,
        command=command,
        env=env,
        ranks=ranks,
        overlay=overlay,
        layers=layers,
    )


def _discover_ranks(runs: list[_Run], cursors: dict[tuple[int, int], RankCursor]) -> None:
    """Compare the ranks a script started itself too, once any run shows them."""
    ranks = max(run.discover() for run in runs)
    first = runs[0]
    for run in runs:
        run.add_ranks(ranks)
    for run in runs[1:]:
        for r in range(ranks):
            if (run.index, r) not in cursors:
                cursors[(run.index, r)] = RankCursor(r, first.tails[r].events, run.tails[r].events)


def _rank_notes(runs: list[_Run], nproc: int | None) -> list[str]:
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
            children.setdefault(line, []).append(run.index + 1)
    for line, indices in children.items():
        notes.append(f"run(s) {', '.join(map(str, indices))}: {line}")
    return notes


def _watch(
    runs: list[_Run],
    *,
    progress: Callable[[CheckProgress], None] | None,
    poll_interval: float,
    stop_early: bool = True,
    serial: bool = False,
) -> tuple[list[tuple[int, Divergence]], list[RankCursor], _Run | None]:
    """Start the runs, compare live; return (divergences, cursors, failed run or None).

    ``serial``: one run at a time, each later one compared live against the first.
    """
    for run in runs[:1] if serial else runs:
        run.start()
    first = runs[0]
    cursors: dict[tuple[int, int], RankCursor] = {}
    for run in runs[1:]:
        for r in range(run.ranks):
            cursors[(run.index, r)] = RankCursor(r, first.tails[r].events, run.tails[r].events)
    found: dict[tuple[int, int], Divergence] = {}
    last_steps: tuple[int, ...] = ()
    failed: _Run | None = None
    while True:
        _discover_ranks(runs, cursors)
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
            break
        if all(done):
            break
        if progress is not None:
            steps = tuple(run.steps_done() for run in runs)
            if steps != last_steps:
                last_steps = steps
                progress(CheckProgress(phase="running", steps=steps))
        time.sleep(poll_interval)
    _discover_ranks(runs, cursors)
    for run in runs:  # events written up to the stop still count
        run.poll()
    for (i, r), cursor in cursors.items():
        d = cursor.advance()
        if d is not None and (i, r) not in found:
            found[(i, r)] = d
    divergences = in_order([(i, d) for (i, _), d in found.items()])  # the one rule compare uses too
    return divergences, list(cursors.values()), failed


def check_script(
    script: str | None,
    args: Sequence[str] = (),
    *,
    module: str | None = None,
    runs: int = 2,
    steps: int | None = None,
    nproc: int | None = None,
    seed: int = 0,
    mode: str = "strict",
    threads: int | None = None,
    cpu_capability: str | None = None,
    no_seed: bool = False,
    vary: str | None = None,
    root: str | os.PathLike[str] = ".torchrepro/checks",
    locate: bool = True,
    serial: bool = False,
    isolate: bool = True,
    progress: Callable[[CheckProgress], None] | None = None,
    poll_interval: float = 0.05,
) -> CheckResult:
    """Run ``script`` ``runs`` times under ``torchrepro run``'s settings and compare them live.

    ``serial=True`` runs one run at a time (each later one compared live against the first):
    slower, but one run's processes at a time (a GPU that fits one run, not two).
    ``isolate=True`` gives each run a copy-on-write view of the working directory (its writes
    end up in its record, never in the user's files) where the kernel allows it.
    Raises ``LaunchError`` when the script or module does not exist and ``ValueError`` for
    invalid options; a failing script is a ``CheckResult`` with ``error`` set.
    """
    if runs < 2:
        raise SettingsError(f"runs must be >= 2 to compare anything, got {runs}")
    if steps is not None and steps < 1:
        raise SettingsError(f"steps must be >= 1, got {steps}")
    if vary is not None and vary not in VARY_CHOICES:
        raise SettingsError(f"vary must be one of {VARY_CHOICES}, got {vary!r}")
    base = ChildSpec(
        cpu_capability=cpu_capability,
        seed=None if no_seed else seed,
        mode=None if no_seed else mode,
        threads=threads,
        max_steps=steps,
    )
    check_target(script, module, args, command="check")
    command = build_command(script, args, module=module, nproc=nproc, watch_writes=True)  # validates nproc
    check_dir = runrecord.new_run_dir(root)
    isolation, layers = _isolation(check_dir, enabled=isolate)
    try:
        return _check(
            check_dir,
            command,
            base,
            isolation=isolation,
            layers=layers,
            script=script,
            module=module,
            runs=runs,
            nproc=nproc,
            seed=seed,
            vary=vary,
            locate=locate,
            serial=serial,
            progress=progress,
            poll_interval=poll_interval,
        )
    finally:
        if layers is not None:
            layers.close()


def _isolation(check_dir: Path, *, enabled: bool) -> tuple[Isolation, Layers | None]:
    """How this check's runs are kept apart, and where their upper layers live."""
    root = os.path.realpath(os.getcwd())
    if not enabled:
        return Isolation(mode="none", root=root, reason="--no-isolate"), None
    layers = Layers.create(check_dir, root)
    if layers is None:
        reason = "no writable directory outside it for the runs' writes"
        return Isolation(mode="none", root=root, reason=reason), None
    user_namespace, refused = probe(layers)
    if refused is not None:
        layers.close()
        return Isolation(mode="none", root=root, reason=f"the kernel refused an overlay ({refused})"), None
    return Isolation(mode="overlay", root=root, user_namespace=user_namespace), layers


def _check(
    check_dir: Path,
    command: list[str],
    base: ChildSpec,
    *,
    isolation: Isolation,
    layers: Layers | None,
    script: str | None,
    module: str | None,
    runs: int,
    nproc: int | None,
    seed: int,
    vary: str | None,
    locate: bool,
    serial: bool,
    progress: Callable[[CheckProgress], None] | None,
    poll_interval: float,
) -> CheckResult:
    ranks = nproc or 1
    specs = [_run_spec(base, vary, i, seed=seed) for i in range(runs)]
    all_runs = [
        _make_run(i, check_dir / f"run{i}", command, specs[i], ranks=ranks, layers=layers)
        for i in range(runs)
    ]
    for run in all_runs:
        runrecord.write_run_files(
            run.record_dir,
            command,
            run_settings(base, run.env, script=script, module=module, nproc=nproc, vary=vary, run=run.index),
        )
    notes = [n for n in [nproc_note(nproc)] if n]
    if isolation.mode == "none" and isolation.reason != "--no-isolate":
        notes.append(f"the runs were not isolated: {isolation.describe()}")
    try:
        with terminate_on_signals():
            divergences, cursors, failed = _watch(
                all_runs, progress=progress, poll_interval=poll_interval, serial=serial
            )
    finally:
        for run in all_runs:
            run.stop()
    ranks = max(run.ranks for run in all_runs)  # with the ranks the script started itself
    rank_notes = _rank_notes(all_runs, nproc)
    notes.extend(rank_notes)
    together = [] if serial else [range(runs)]
    shared = shared_writes(
        [run.record_dir for run in all_runs], together, isolation=isolation, check_dir=check_dir
    )
    if failed is not None:
        error = f"run {failed.index + 1} of {runs} failed with exit code {failed.returncode}"
        if shared:
            error += f" after {describe_shared(shared, isolation=isolation)}"
        result = CheckResult(
            reproducible=None,
            runs=runs,
            steps_compared=steps_compared(cursors),
            first_divergence=None,
            check_dir=os.fspath(check_dir),
            error=error,
            returncode=failed.returncode,
            stderr_tail=failed.stderr_tail(),
            notes=tuple(notes),
            coverage=coverage(cursors, range(ranks)),
            isolation=isolation,
            shared_writes=tuple(shared),
        )
        runrecord.write_verdict(check_dir, result.to_dict())
        return result
    other, first = divergences[0] if divergences else (1, None)
    if first is not None and first.kind == "compute" and locate:
        if progress is not None:
            progress(CheckProgress(phase="locating", steps=()))
        with terminate_on_signals():  # SIGTERM while locating ends the traced re-runs too
            first, locate_notes = _locate(
                first,
                check_dir,
                command,
                (specs[0], specs[other]),
                ranks=ranks,
                layers=layers,
                progress=progress,
                poll_interval=poll_interval,
                serial=serial,
            )
        notes.extend(locate_notes)
    covered = coverage(cursors, range(ranks))
    reproducible: bool | None = first is None
    if first is None and not covered.conclusive:
        reproducible = None
        notes.append(covered.inconclusive_note())
    elif first is None and rank_notes:
        reproducible = None
        notes.append("inconclusive: a python process the script started trained unrecorded (above)")
    if vary == "workers" and runs > 1:
        varied_note, varied_anything = _varied_workers(all_runs[1], ranks)
        notes.append(varied_note)
        if first is None and not varied_anything and reproducible:
            reproducible = None
            notes.append(
                "inconclusive: --vary workers varied nothing (the script created no DataLoader), so "
                "the runs were not loaded differently; the verdict would only repeat a plain check"
            )
    if shared:
        notes.append(describe_shared(shared, isolation=isolation))
    result = CheckResult(
        reproducible=reproducible,
        runs=runs,
        steps_compared=steps_compared(cursors),
        first_divergence=first,
        check_dir=os.fspath(check_dir),
        notes=tuple(notes),
        coverage=covered,
        isolation=isolation,
        shared_writes=tuple(shared),
    )
    runrecord.write_verdict(check_dir, result.to_dict())
    return result


def _locate(
    first: Divergence,
    check_dir: Path,
    command: list[str],
    specs: tuple[ChildSpec, ChildSpec],
    *,
    ranks: int,
    layers: Layers | None,
    progress: Callable[[CheckProgress], None] | None,
    poll_interval: float,
    serial: bool = False,
) -> tuple[Divergence, list[str]]:
    """Re-run both sides with op tracing at the divergent step; fill op/module/location."""
    k = first.step
    notes: list[str] = []
    for attempt in range(LOCATE_ATTEMPTS):
        base = check_dir / f"locate{attempt}"
        sides = []
        for side, (index, spec) in zip("ab", enumerate(specs), strict=True):
            traced = spec.replace(
                max_steps=k + 1,
                trace_step=k,
                trace_out=os.fspath((base / f"trace-{side}").resolve()),
                trace_optimizer=optimizer_index(first.key),
            )
            sides.append(_make_run(index, base / f"run-{side}", command, traced, ranks=ranks, layers=layers))
        try:
            divergences, _, failed = _watch(
                sides, progress=None, poll_interval=poll_interval, stop_early=False, serial=serial
            )
        except Exception as exc:
            notes.append(f"locating failed: {type(exc).__name__}: {exc}")
            return first, notes
        finally:
            for run in sides:
                run.stop()
        if failed is not None:
            notes.append(f"locating: the traced re-run failed with exit code {failed.returncode}")
            return first, notes
        traces = [
            (r, runrecord.trace_path(base / "trace-a", r), runrecord.trace_path(base / "trace-b", r))
            for r in range(ranks)
        ]
        traces = [(r, a, b) for r, a, b in traces if a.exists() and b.exists()]
        if not traces:
            notes.append("locating: no op trace was written (op tracing unavailable in this build)")
            return first, notes
        located, compare_notes, failed_ranks = locate_in_traces(first, traces, varied=_varied_setting(specs))
        notes.extend(f"locating: {note}" for note in compare_notes)
        if located is not None:
            return located, notes
        if failed_ranks:
            ranks_text = ", ".join(map(str, failed_ranks))
            notes.append(
                f"locating: the op traces of rank(s) {ranks_text} could not be compared: the op is unknown"
            )
            return first, notes
        same = not divergences
        what = (
            f"did not diverge at step {k} (intermittent nondeterminism)"
            if same
            else "diverged, but no op with equal inputs and different outputs was found"
        )
        notes.append(f"locating attempt {attempt + 1}: the traced re-runs {what}")
    return first, notes
