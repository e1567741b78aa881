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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrepro import runrecord
from torchrepro._child.spec import ChildSpec, python_hash_seed
from torchrepro.check_runs import CheckProgress, make_run, rank_notes, varied_workers, watch
from torchrepro.compare import (
    Coverage,
    Divergence,
    coverage,
    locate_in_traces,
    steps_compared,
)
from torchrepro.errors import SettingsError
from torchrepro.events import optimizer_index
from torchrepro.isolation import Isolation, Layers, describe_shared, probe, shared_writes
from torchrepro.launch import (
    build_command,
    check_target,
    nproc_note,
    run_settings,
    terminate_on_signals,
)

__all__ = ["VARY_CHOICES", "CheckProgress", "CheckResult", "check_script"]

VARY_CHOICES = ("workers", "threads", "hashseed")
"""What ``--vary`` can change in later runs."""

LOCATE_ATTEMPTS = 3


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


def _varied_setting(specs: tuple[ChildSpec, ChildSpec]) -> str | None:
    """How ``--vary threads`` started the two located runs differently, in words (else None)."""
    a, b = specs
    if a.threads is None or b.threads is None or a.threads == b.threads:
        return None

    def threads(n: int) -> str:
        return f"{n} thread{'s' if n != 1 else ''}"

    return f"between {threads(a.threads)} (first run) and {threads(b.threads)} (other run)"


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
        make_run(i, check_dir / f"run{i}", command, specs[i], ranks=ranks, layers=layers) for i in range(runs)
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
            divergences, cursors, failed = watch(
                all_runs, progress=progress, poll_interval=poll_interval, serial=serial
            )
    finally:
        for run in all_runs:
            run.stop()
    ranks = max(run.ranks for run in all_runs)  # with the ranks the script started itself
    unranked = rank_notes(all_runs, nproc)
    notes.extend(unranked)
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
    elif first is None and unranked:
        reproducible = None
        notes.append("inconclusive: a python process the script started trained unrecorded (above)")
    if vary == "workers" and runs > 1:
        varied_note, varied_anything = varied_workers(all_runs[1], ranks)
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
            sides.append(make_run(index, base / f"run-{side}", command, traced, ranks=ranks, layers=layers))
        try:
            divergences, _, failed = watch(
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
