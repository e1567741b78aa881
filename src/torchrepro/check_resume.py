"""``torchrepro check --vary resume``: does a script, with its own checkpoints, resume exactly?

Run 1 trains uninterrupted. For every kill point K (``resume_at``; default the middle of run 1's
optimizer steps) another run is SIGKILLed, every process of it at once, once its first optimizer
is about to take step K+1 (so whatever the script saves after step K is saved), and is started
again with the same command (plus ``resume_args``) in the files it left: its own copy-on-write
view of the working directory (``isolation``), so it finds its checkpoints and the user's files
stay untouched.

Invariants:
- Until the kill, the killed run is compared with run 1 as a plain check compares runs: a
  divergence there is an ordinary one (the script is not reproducible even uninterrupted).
- The restarted run counts its steps from 0 and may load an older checkpoint than step K: it is
  aligned with run 1 by the state it starts from (``compare.resume``), never by counters. It is
  then compared step by step with run 1's steps from there on; a restart that restored nothing
  (trained from the start again), one that cannot be aligned, or a kill point the script never
  reached makes the check inconclusive (exit 3), never a pass.
- Without isolation nothing can be restarted in its own files: the check is inconclusive with the
  reason (``CheckOptions`` refuses ``isolate=False`` with ``vary="resume"``).
- Paths outside the working directory (which is all isolation covers) that the runs both wrote
  are named in a note: a restart may have read another run's checkpoint there.
- Every process started is ended on return, on an exception, on Ctrl-C and on SIGTERM; each run's
  records are ``run0`` (run 1), ``run<i>`` (killed at the i-th point) and ``run<i>-resumed``.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torchrepro import runrecord
from torchrepro.check_runs import CheckProgress, Run, make_run, same_rank
from torchrepro.compare.alignment import RankCursor
from torchrepro.compare.resume import ResumedRank, align_resumed
from torchrepro.errors import ReproError
from torchrepro.events import in_order
from torchrepro.isolation import Layers, shared_writes
from torchrepro.launch import run_settings, terminate_on_signals
from torchrepro.options import CheckOptions
from torchrepro.protocol import ChildSpec
from torchrepro.results import CheckResult, Coverage, Divergence, Isolation, ResumePoint, ResumeScope
from torchrepro.verdict import describe_isolation

__all__ = ["KILL_GRACE", "check_resume"]

KILL_GRACE = 30.0
"""Seconds the check waits, once one rank reached its kill point, for the others before it kills
the run anyway (a rank that never steps the first optimizer)."""


@dataclass
class _Point:
    """One kill point: the run killed there and, after the kill, its restart."""

    kill_after: int
    killed: Run
    cursors: list[RankCursor] = field(default_factory=list)
    reached_at: float | None = None
    restarted: Run | None = None
    never_reached: int | None = None  # the killed run ended by itself after this many steps
    late_ranks: tuple[int, ...] = ()

    @property
    def done(self) -> bool:
        if self.restarted is not None:
            return self.restarted.returncode is not None
        return self.never_reached is not None or (self.killed.returncode not in (None, 0))


def _result(
    check_dir: Path,
    *,
    reproducible: bool | None,
    notes: list[str],
    isolation: Isolation,
    steps_compared: int = 0,
    first_divergence: Divergence | None = None,
    **values: object,
) -> CheckResult:
    """The verdict (written to ``check_dir``); nothing compared unless said."""
    result = CheckResult(
        reproducible=reproducible,
        runs=2,
        check_dir=os.fspath(check_dir),
        notes=tuple(notes),
        isolation=isolation,
        steps_compared=steps_compared,
        first_divergence=first_divergence,
        **values,  # type: ignore[arg-type]
    )
    runrecord.write_verdict(check_dir, result.to_dict())
    return result


def check_resume(
    check_dir: Path,
    command: list[str],
    resume_command: list[str],
    base: ChildSpec,
    options: CheckOptions,
    *,
    isolation: Isolation,
    layers: Layers | None,
    script: str | None,
    module: str | None,
    progress: Callable[[CheckProgress], None] | None,
    start_notes: Sequence[str] = (),
) -> CheckResult:
    """The check of ``check_script(..., vary="resume")``: ``command`` starts run 1 and the runs that
    are killed, ``resume_command`` the restarts."""
    notes = list(start_notes)
    ranks = options.nproc or 1
    resume_text = f" {shlex.join(options.resume_args)}" if options.resume_args else ""
    varied = f"killed (SIGKILL) and started again{' with' + resume_text if resume_text else ''}"
    if layers is None:
        reason = (
            "--vary resume starts the killed run again in the files it wrote, in a copy of the working "
            f"directory of its own, and here the runs could not be isolated: {describe_isolation(isolation)}"
        )
        return _result(
            check_dir,
            reproducible=None,
            notes=notes,
            isolation=isolation,
            reason=reason,
            varied=varied,
        )
    spec = base.replace(resume_states=True)

    def settings(run: Run) -> None:
        runrecord.write_run_files(
            run.record_dir,
            run.command,
            run_settings(
                spec, run.env, script=script, module=module, nproc=options.nproc, vary="resume", run=run.index
            ),
        )

    first = make_run(0, check_dir / "run0", command, spec, ranks=ranks, layers=layers)
    settings(first)
    points: list[_Point] = []
    all_runs = [first]

    def add_points(steps: Sequence[int]) -> None:
        for i, k in enumerate(steps, start=1):
            killed = make_run(
                i, check_dir / f"run{i}", command, spec.replace(kill_at=k), ranks=ranks, layers=layers
            )
            settings(killed)
            points.append(_Point(k, killed))
            all_runs.append(killed)

    planned = options.resume_at
    if planned is None and base.max_steps is not None:
        planned = (max(1, base.max_steps // 2),)
    try:
        with terminate_on_signals():
            first.start()
            if planned is None:  # the middle of run 1's steps: known once it has ended
                failed = _drive(first, [], progress, options.poll_interval, ranks)
                if failed is not None:
                    return _failed(check_dir, failed, notes, isolation, varied)
                taken = first.steps_done()
                if taken < 2:
                    reason = (
                        f"resuming needs a run of at least 2 optimizer steps (one before the kill, one "
                        f"after); the script took {taken}"
                    )
                    return _result(
                        check_dir,
                        reproducible=None,
                        notes=notes,
                        isolation=isolation,
                        reason=reason,
                        varied=varied,
                    )
                planned = (taken // 2,)
                notes.append(
                    f"--vary resume: run 1 took {taken} optimizer steps; killed after step {planned[0]}"
                )
            add_points(planned)
            for point in points:
                point.killed.start()

            def restart(point: _Point) -> Run:
                assert layers is not None
                record = check_dir / f"run{point.killed.index}-resumed"
                overlay = layers.hand_over(point.killed.record_dir, record)
                run = make_run(point.killed.index, record, resume_command, spec, ranks=ranks, overlay=overlay)
                settings(run)
                all_runs.append(run)
                return run

            failed = _drive(first, points, progress, options.poll_interval, ranks, restart=restart)
    finally:
        for run in all_runs:
            run.stop()
    # run 1 and the killed runs ran together: paths outside the working directory that they both
    # wrote (a checkpoint directory under /tmp) may have been read by a restart from another run
    records = [run.record_dir for run in all_runs]
    shared = shared_writes(records, [range(len(all_runs))], isolation=isolation, check_dir=check_dir)
    written = shared or shared_writes(  # one run's checkpoint there may have been read by another
        records, [range(len(all_runs))], isolation=isolation, check_dir=check_dir, least=1
    )
    if written:
        shown = ", ".join(written[:3]) + (f" and {len(written) - 3} more" if len(written) > 3 else "")
        who = "the runs wrote the same path(s)" if shared else "a run wrote path(s)"
        notes.append(
            f"{who} outside the working directory {isolation.root}, which is all a check isolates: "
            f"{shown}; a run may have read another's checkpoint there: give the script's checkpoints "
            "a path inside the working directory (a relative one)"
        )
    if failed is not None:
        return _failed(check_dir, failed, notes, isolation, varied)
    return _verdict(check_dir, first, points, base, notes, isolation, varied, ranks)


def _failed(check_dir: Path, failed: Run, notes: list[str], isolation: Isolation, varied: str) -> CheckResult:
    what = f"run {failed.index + 1}"
    if failed.record_dir.name.endswith("-resumed"):
        what = (
            f"the restart of run {failed.index + 1} (started again in the files it left when it was killed)"
        )
    return _result(
        check_dir,
        reproducible=None,
        notes=notes,
        isolation=isolation,
        error=f"{what} failed with exit code {failed.returncode}",
        returncode=failed.returncode,
        stderr_tail=failed.stderr_tail(),
        varied=varied,
    )


def _drive(
    first: Run,
    points: list[_Point],
    progress: Callable[[CheckProgress], None] | None,
    poll_interval: float,
    ranks: int,
    *,
    restart: Callable[[_Point], Run] | None = None,
) -> Run | None:
    """Run until run 1 and every point's restart ended; kill each point's run at its kill point and
    restart it. Returns the first run that failed (None: none); stops early at a divergence before
    a kill (the runs are then ended by the caller)."""
    last: tuple[int, ...] = ()
    while True:
        first_done = first.poll()
        if first_done and first.returncode != 0:
            return first
        for point in points:
            if point.restarted is not None:
                if point.restarted.poll() and point.restarted.returncode != 0:
                    return point.restarted
                continue
            if point.never_reached is not None:
                continue
            ended = point.killed.poll()
            reached = runrecord.killpoints(point.killed.record_dir)
            expected = set(range(max(ranks, point.killed.discover())))
            if reached and point.reached_at is None:
                point.reached_at = time.monotonic()
            if reached and (reached >= expected or time.monotonic() - point.reached_at > KILL_GRACE):  # type: ignore[operator]
                point.late_ranks = tuple(sorted(expected - reached))
                point.killed.poll()  # the events written up to the kill point
                point.killed.layers = None  # its files go on in the restart
                point.killed.stop()
                for tail in point.killed.tails:
                    tail.poll()
                assert restart is not None
                point.restarted = restart(point)
                point.restarted.start()
            elif ended:
                if point.killed.returncode != 0:
                    return point.killed
                point.never_reached = point.killed.steps_done()
            if not point.cursors or len(point.cursors) < len(point.killed.tails):
                first.add_ranks(point.killed.discover())
                point.killed.add_ranks(first.ranks)
                point.cursors = [same_rank(first, point.killed, r) for r in range(first.ranks)]
            if any(c.advance(a_done=first_done) is not None for c in point.cursors):
                return None  # the runs part before the kill: an ordinary divergence
        if first_done and all(p.done for p in points):
            return None
        if progress is not None:
            steps = (first.steps_done(), *(_steps(p) for p in points))
            if steps != last:
                last = steps
                progress(CheckProgress(phase="running", steps=steps))
        time.sleep(poll_interval)


def _steps(point: _Point) -> int:
    """The steps of a point's runs so far, in run 1's count once restarted (before the alignment is
    known: the kill point plus the restart's own steps)."""
    if point.restarted is None:
        return point.killed.steps_done()
    return point.kill_after + point.restarted.steps_done()


def _verdict(
    check_dir: Path,
    first: Run,
    points: list[_Point],
    base: ChildSpec,
    notes: list[str],
    isolation: Isolation,
    varied: str,
    ranks_expected: int,
) -> CheckResult:
    ranks = max([first.discover(), ranks_expected, *(p.killed.discover() for p in points)])
    for run in [first, *(p.killed for p in points)]:
        run.add_ranks(ranks)
        run.poll()
    before: list[tuple[int, Divergence]] = []
    per_rank: dict[int, dict[str, int]] = {}

    def count(rank: int, compared: dict[str, int]) -> None:
        counts = per_rank.setdefault(rank, {})
        for kind, n in compared.items():
            counts[kind] = counts.get(kind, 0) + n

    for point in points:
        for r in range(ranks):
            cursor = RankCursor(r, first.tails[r].events, point.killed.tails[r].events)
            # a run that was never killed ran to its end: every event it lacks is a difference
            d = cursor.advance(a_done=True, b_done=point.never_reached is not None)
            count(r, cursor.compared)
            if d is not None:
                before.append((point.killed.index, d))
    if before:
        _, d = in_order(before)[0]
        coverage = Coverage(per_rank=per_rank, ranks_expected=tuple(range(ranks)))
        notes.append(
            "the runs parted before the kill: the script is not reproducible even uninterrupted; a plain "
            "`torchrepro check` locates the op"
        )
        return _result(
            check_dir,
            reproducible=False,
            notes=notes,
            isolation=isolation,
            steps_compared=d.step + 1,
            first_divergence=d,
            coverage=coverage,
            varied=varied,
            reason=f"the runs part at step {d.step}, before the kill (run {2 if len(points) == 1 else '2..'} "
            "was not yet interrupted)",
        )
    compare_final = base.max_steps is None
    resumed: list[ResumePoint] = []
    found: list[tuple[int, ResumedRank]] = []
    problems: list[tuple[int, str]] = []
    for i, point in enumerate(points):
        if point.never_reached is not None:
            problems.append(
                (
                    i,
                    f"the run meant to be killed after step {point.kill_after} ended by itself after "
                    f"{point.never_reached} optimizer step(s), so it was never killed: give --resume-at "
                    "below the script's number of steps",
                )
            )
            resumed.append(ResumePoint(point.kill_after, None, 0))
            continue
        if point.late_ranks:
            notes.append(
                f"rank(s) {', '.join(map(str, point.late_ranks))} had not reached step "
                f"{point.kill_after + 1} "
                f"{KILL_GRACE:.0f} s after the first rank did; the run was killed anyway"
            )
        assert point.restarted is not None
        ranks_here = max(ranks, point.restarted.discover())
        point.restarted.add_ranks(ranks_here)
        first.add_ranks(ranks_here)
        point.restarted.poll()
        aligned = []
        for r in range(ranks_here):
            try:
                a_states = runrecord.read_states(first.record_dir, r)
                b_states = runrecord.read_states(point.restarted.record_dir, r)
            except ReproError as exc:
                aligned.append(ResumedRank(r, None, problem=str(exc)))
                continue
            aligned.append(
                align_resumed(
                    first.tails[r].events,
                    a_states,
                    point.restarted.tails[r].events,
                    b_states,
                    rank=r,
                    kill_after=point.kill_after,
                    compare_final=compare_final,
                )
            )
        for a in aligned:
            count(a.rank, a.compared)
        unaligned = [a for a in aligned if a.problem is not None]
        diverged = [a for a in aligned if a.divergence is not None]
        restored = {a.restored_at for a in aligned if a.restored_at is not None}
        if len(restored) > 1:
            problems.append(
                (i, f"the ranks restored different steps ({', '.join(map(str, sorted(restored)))})")
            )
        restored_at = min(restored) if restored else None
        steps = min((a.steps_compared for a in aligned if a.problem is None), default=0)
        if diverged:
            steps = min(a.steps_compared for a in diverged)
        resumed.append(ResumePoint(point.kill_after, restored_at, steps))
        for a in unaligned:
            problems.append((i, f"rank {a.rank}: {a.problem}" if ranks_here > 1 else str(a.problem)))
        for a in diverged:
            found.append((i, a))
    coverage = Coverage(per_rank=per_rank, ranks_expected=tuple(range(ranks)))
    if found:
        i, first_found = min(found, key=lambda x: (x[0], x[1].divergence.step, x[1].rank))  # type: ignore[union-attr]
        scope = ResumeScope(tuple(resumed), reported=i)
        d = first_found.divergence
        assert d is not None
        reported = resumed[i]
        others = [  # the all-reduced gradients spread one rank's difference to every rank
            f"on rank {a.rank}, {a.explanation}"
            for j, a in found
            if j == i
            and a is not first_found
            and a.explanation
            and a.divergence
            and a.divergence.step == d.step
        ]
        reason = (
            first_found.explanation
            or (others[0] if others else None)
            or (
                f"the restarted run's step {d.step} is not the uninterrupted run's (see the differing tensor)"
            )
        )
        return _result(
            check_dir,
            reproducible=False,
            notes=notes,
            isolation=isolation,
            steps_compared=(reported.restored_at or 0) + reported.steps_compared,
            first_divergence=d,
            coverage=coverage,
            reason=reason,
            varied=varied,
            resume=scope,
            optimizer_steps={"optimizer0": reported.steps_compared},
        )
    if problems:
        i, problem = problems[0]
        notes.extend(f"killed after step {points[j].kill_after}: {p}" for j, p in problems[1:])
        return _result(
            check_dir,
            reproducible=None,
            notes=notes,
            isolation=isolation,
            coverage=coverage,
            reason=f"killed after step {points[i].kill_after}: {problem}",
            varied=varied,
            resume=ResumeScope(tuple(resumed), reported=i),
        )
    total = max(((p.restored_at or 0) + p.steps_compared for p in resumed), default=0)
    if not compare_final:
        notes.append(
            f"--steps {base.max_steps}: the runs stopped after that many optimizer steps of their own, "
            "so the state at exit was not compared"
        )
    return _result(
        check_dir,
        reproducible=True,
        notes=notes,
        isolation=isolation,
        steps_compared=total,
        coverage=coverage,
        varied=varied,
        resume=ResumeScope(tuple(resumed)),
        optimizer_steps={"optimizer0": min(p.steps_compared for p in resumed)},
    )
