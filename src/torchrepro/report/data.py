"""What a report page shows, gathered from a verdict and the run records (``ReportData``).

Invariants: everything comes from the records (events, ``command.json``, ``settings.json``,
``env.json``) and the verdict; the only other file read is the source file a divergence names,
for the lines around it; the data are plain and JSON-able (the page embeds them).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrepro import runrecord
from torchrepro.compare.differences import recorded_numbers, tensor_difference
from torchrepro.compare.settings import env_difference_dict, environment_differences, setting_differences
from torchrepro.errors import ReproError
from torchrepro.events import describe_name
from torchrepro.runrecord import RunRecord
from torchrepro.verdict import (
    describe_check,
    describe_comparison,
    describe_divergence,
    describe_final_state,
    describe_setting,
)

if TYPE_CHECKING:
    from torchrepro.results import CheckResult, Comparison, Divergence, ResumeScope, TensorDifference
from torchrepro.report.distances import Series, distance_series, record_series, resumed_record

__all__ = [
    "REPORT_FORMAT",
    "ReportData",
    "SourceExcerpt",
    "check_report_data",
    "compare_report_data",
    "source_excerpt",
]


REPORT_FORMAT = 1


_SOURCE_CONTEXT = 5  # lines shown before and after the line a divergence names


@dataclass(frozen=True)
class SourceExcerpt:
    """The lines around the line a divergence names (``first`` is the number of ``lines[0]``)."""

    path: str
    line: int
    first: int
    lines: tuple[str, ...]


@dataclass(frozen=True)
class ReportData:
    """Everything a report page shows (``render_report`` turns it into HTML)."""

    title: str
    outcome: str
    """The verdict's ``Outcome`` (its value): the badge's colour."""
    status: str
    """The outcome in the command's words: ``reproducible``/``identical``, ``not reproducible``/``not
    identical``, ``inconclusive`` or ``failed``."""
    headline: tuple[str, ...]
    command: tuple[str, ...] = ()
    divergence: dict[str, Any] | None = None
    divergence_text: str | None = None
    tensor: dict[str, Any] | None = None
    source: SourceExcerpt | None = None
    series: tuple[Series, ...] = ()
    marks: tuple[tuple[int, str], ...] = ()
    """Steps the plot marks with a line and a label (``check --vary resume``: the kill and the
    step the restart resumed at)."""
    settings: tuple[str, ...] = ()
    commands: tuple[tuple[str, ...], ...] = ()
    environment: tuple[dict[str, Any], ...] = ()
    threads: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    records: tuple[str, ...] = ()
    verdict: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    stderr_tail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON the page embeds (strict JSON: no NaN or infinity)."""
        d = asdict(self)
        d["format"] = REPORT_FORMAT
        return d


def source_excerpt(location: str | None, cwd: str | None) -> SourceExcerpt | None:
    """The lines around ``location`` (``path:line``, relative to ``cwd`` unless absolute), or None
    when it names no line or the file cannot be read."""
    if not location or ":" not in location:
        return None
    path, _, number = location.rpartition(":")
    if not number.isdigit() or not path:
        return None
    line = int(number)
    full = Path(path) if os.path.isabs(path) or cwd is None else Path(cwd) / path
    try:
        text = full.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    if not 1 <= line <= len(text):
        return None
    first = max(1, line - _SOURCE_CONTEXT)
    return SourceExcerpt(
        path=path, line=line, first=first, lines=tuple(text[first - 1 : line + _SOURCE_CONTEXT])
    )


def _command(record: str | os.PathLike[str]) -> tuple[tuple[str, ...], str | None]:
    """The argv and working directory a run record was started with (empty, None: not recorded)."""
    try:
        data = runrecord.read_json(Path(record) / runrecord.COMMAND_FILE)
    except ReproError:
        return (), None
    if not isinstance(data, dict):
        return (), None
    argv = data.get("argv")
    cwd = data.get("cwd")
    argv_t = tuple(str(x) for x in argv) if isinstance(argv, list) else ()
    return _user_command(argv_t), cwd if isinstance(cwd, str) else None


def _user_command(argv: tuple[str, ...]) -> tuple[str, ...]:
    """A run's command line as the user would type it: ``python script.py ...`` (or ``torchrun
    --nproc-per-node=N script.py ...``) without torchrepro's bootstrap in between."""
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1].startswith("torchrepro._child"):
            target = argv[i + 2 :]
            target = target[1:] if target[:1] == ("--",) else target
            nproc = [a for a in argv[:i] if a.startswith("--nproc-per-node=")]
            return ("torchrun", nproc[0], *target) if nproc else ("python", *target)
    return argv


def _differences(a: RunRecord, b: RunRecord) -> tuple[tuple[str, ...], tuple[dict[str, Any], ...]]:
    """How two records were started differently (in words) and their environment differences."""
    envs, _ = environment_differences(a, b)
    started = setting_differences(a, b)
    return tuple(describe_setting(d) for d in started), tuple(env_difference_dict(d, started) for d in envs)


def _divergence_fields(
    d: Divergence | None, cwd: str | None
) -> tuple[dict[str, Any] | None, str | None, Any]:
    if d is None:
        return None, None, None
    text = describe_final_state(d) if d.final_state else describe_divergence(d)
    return {**d.to_dict(), "what": d.what()}, text, source_excerpt(d.location, cwd)


def check_report_data(result: CheckResult) -> ReportData:
    """What the report of a check shows."""
    check_dir = Path(result.check_dir)
    run_dirs = [check_dir / f"run{i}" for i in range(result.runs)]
    records: list[RunRecord | None] = []
    for run in run_dirs:
        try:
            records.append(runrecord.load_run(run))
        except ReproError:  # a run that wrote no events (it failed to start): the verdict says why
            records.append(None)
    first = records[0]
    argv, cwd = _command(run_dirs[0])
    series = [
        record_series(first, record, label=f"run {i + 1} vs run 1")
        for i, record in enumerate(records[1:], start=1)
        if first is not None and record is not None
    ]
    marks: tuple[tuple[int, str], ...] = ()
    if result.resume is not None and first is not None:  # the restart, stitched after what it restored
        series, marks = _resumed_series(check_dir, first, result.resume)
    settings: tuple[str, ...] = ()
    environment: tuple[dict[str, Any], ...] = ()
    if first is not None and len(records) > 1 and records[1] is not None:
        settings, environment = _differences(first, records[1])
    commands = tuple(c for c in (_command(r)[0] for r in run_dirs) if c)
    divergence, text, source = _divergence_fields(result.first_divergence, cwd)
    headline = (
        tuple(describe_check(result)) if result.error is None else (f"the script failed: {result.error}",)
    )
    d = result.first_divergence
    found = None if d is None else _divergent_events(d, records)
    differing = None if found is None else tensor_difference(found[0], found[1])
    tensor = None if d is None or d.unmatched else differing
    threads = None
    if result.varied and "threads" in result.varied and d is not None:
        threads = _threads_section(result.varied, d, found, differing)
    if threads is not None and result.repro is not None:  # the op itself, called under both counts
        threads.update(repro_script=result.repro.script, repro_output=result.repro.output)
    return ReportData(
        title=f"torchrepro check: {_shown_target(argv)}",
        outcome=result.outcome.value,
        status=result.outcome.words(),
        headline=headline,
        command=argv,
        divergence=divergence,
        divergence_text=text,
        tensor=None if tensor is None else tensor.to_dict(),
        source=source,
        series=tuple(series),
        marks=marks,
        settings=settings,
        commands=commands if len(set(commands)) > 1 else (),
        environment=environment,
        threads=threads,
        notes=result.notes,
        records=(os.fspath(check_dir),),
        verdict=result.to_dict(),
        error=result.error,
        stderr_tail=result.stderr_tail,
    )


def _resumed_series(
    check_dir: Path, first: RunRecord, resume: ResumeScope
) -> tuple[list[Series], tuple[tuple[int, str], ...]]:
    """The restart of the reported point against run 1 (its steps numbered as run 1's), and the
    kill and resume points to mark."""
    index = resume.reported
    point = resume.points[index]
    marks = [(point.killed_after, f"killed after step {point.killed_after}")]
    if point.restored_at is None:
        return [], tuple(marks)
    marks.append((point.restored_at, f"resumed at step {point.restored_at}"))
    try:
        restarted = runrecord.load_run(check_dir / f"run{index + 1}-resumed")
    except ReproError:
        return [], tuple(marks)
    stitched = resumed_record(first, restarted, point.restored_at)
    label = f"run {index + 2} (killed after step {point.killed_after}, resumed) vs run 1"
    return [record_series(first, stitched, label=label)], tuple(marks)


def compare_report_data(
    result: Comparison, run_a: str | os.PathLike[str], run_b: str | os.PathLike[str]
) -> ReportData:
    """What the report of ``compare RUN_A RUN_B`` shows."""
    argv, cwd = _command(run_a)
    series = (distance_series(run_a, run_b, label="run B vs run A"),)
    divergence, text, source = _divergence_fields(result.first_divergence, cwd)
    commands = tuple(c for c in (_command(r)[0] for r in (run_a, run_b)) if c)
    return ReportData(
        title=f"torchrepro compare: {os.fspath(run_a)} vs {os.fspath(run_b)}",
        outcome=result.outcome.value,
        status=result.outcome.words(runs="identical"),
        headline=tuple(describe_comparison(result)),
        command=argv,
        divergence=divergence,
        divergence_text=text,
        tensor=None if result.tensor is None else result.tensor.to_dict(),
        source=source,
        series=series,
        settings=tuple(describe_setting(d) for d in result.setting_differences),
        commands=commands if len(set(commands)) > 1 else (),
        environment=result.environment,
        notes=result.notes,
        records=(os.fspath(run_a), os.fspath(run_b)),
        verdict=result.to_dict(),
    )


def _shown_target(argv: Sequence[str]) -> str:
    """The script a command line runs, for a title (its last ``.py`` argument, else the argv)."""
    scripts = [a for a in argv if a.endswith(".py")]
    return os.path.basename(scripts[-1]) if scripts else " ".join(argv[-2:]) or "script"


def _divergent_events(
    d: Divergence, records: Sequence[RunRecord | None]
) -> tuple[dict[str, Any], dict[str, Any], int] | None:
    """The first run's and a later run's events where ``d`` is, and the later run's index."""
    if records[0] is None:
        return None
    a = records[0].events.get(d.rank, [])
    for i, record in enumerate(records[1:], start=1):
        b = [] if record is None else record.events.get(d.rank, [])
        if d.index < len(a) and d.index < len(b) and a[d.index]["fp"] != b[d.index]["fp"]:
            return a[d.index], b[d.index], i
    return None


def _threads_section(
    varied: str,
    d: Divergence,
    found: tuple[dict[str, Any], dict[str, Any], int] | None,
    tensor: TensorDifference | None,
) -> dict[str, Any]:
    """For ``--vary threads``: the op located, and what the step computed under both thread counts
    (the first differing tensor's recorded values side by side); ``check_report_data`` adds what
    the op itself gave under both (the standalone script's output) when the check wrote one."""
    section: dict[str, Any] = {"varied": varied, "op": d.op, "location": d.location, "module": d.module}
    if found is None or tensor is None:
        return section
    a, b, later = found
    la, lb = a["t"][tensor.leaf], b["t"][tensor.leaf]
    key = "v" if recorded_numbers(la.get("v")) is not None else "s"
    section["tensor"] = describe_name(tensor.name, a["kind"]) if tensor.name else None
    section["shape"], section["dtype"] = tensor.shape, tensor.dtype
    section["sampled"] = key == "s"
    section["values"] = [recorded_numbers(la.get(key)), recorded_numbers(lb.get(key))]
    section["runs"] = [1, later + 1]
    return section
