"""The HTML report of a check or a comparison: one self-contained page a person can look at.

``check --report out.html`` and ``compare --report out.html`` write it (``write_check_report``,
``write_compare_report``); ``pytest --torchrepro-report DIR`` writes one per failing test.

Invariants:
- One file, self-contained: inline CSS and inline SVG, no script that runs, no font, image or
  link that loads anything; it opens offline and from an attachment. The report's data are also
  embedded as JSON (``<script type="application/json" id="torchrepro-data">``), so a program can
  read what the page shows.
- Everything shown comes from the run records (events, ``command.json``, ``settings.json``,
  ``env.json``) and the verdict; the only other file read is the source file a divergence names,
  for the lines around it. Every text from a record or the user's source is escaped.
- The distance plot has one point per compared step of every series (a later run against the
  first, all ranks together): how many tensors differ (bars) and the largest absolute difference
  seen (log scale). That difference comes from the recorded values: every value of a tensor of
  at most 64 elements, ``recorder.SAMPLE_SIZE`` evenly spaced values of a larger floating one, so
  it is a lower bound; a step whose tensors differ where no recorded value does is drawn apart, as
  is a step where they are equal.
- A report is written atomically and never over a file that is not a torchrepro report
  (``check_report_path`` refuses it before a check starts).
- Standard library only, apart from what the check and compare modules import.
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrepro import runrecord
from torchrepro._io import atomic_write_bytes
from torchrepro.compare.differences import leaf_difference, recorded_numbers, tensor_difference
from torchrepro.compare.settings import env_difference_dict, environment_differences, setting_differences
from torchrepro.errors import ReproError, SettingsError
from torchrepro.events import FINAL_KEY, describe_name, is_step, world_invariant
from torchrepro.results import Outcome
from torchrepro.runrecord import RunRecord
from torchrepro.verdict import (
    describe_check,
    describe_comparison,
    describe_divergence,
    describe_final_state,
    describe_setting,
)

if TYPE_CHECKING:
    from torchrepro.results import CheckResult, Comparison, Divergence, TensorDifference

__all__ = [
    "GENERATOR",
    "Series",
    "StepDistance",
    "check_report_path",
    "distance_series",
    "render_report",
    "write_check_report",
    "write_compare_report",
]

GENERATOR = "torchrepro report"
"""The ``<meta name="generator">`` of every report: a file holding it may be written over."""

REPORT_FORMAT = 1
_SOURCE_CONTEXT = 5  # lines shown before and after the line a divergence names
_MAX_POINTS = 5000  # steps plotted per series (a longer run is plotted up to there, and says so)


# --------------------------------------------------------------------------------------------
# Distances per step, from two runs' events
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepDistance:
    """How far two runs are apart at one training step (its batches, recorded values and update).

    ``largest`` is the largest ``|a-b|`` among the recorded values of the tensors that differ (None:
    no recorded value differs, or ``nonfinite``); ``exact`` is True when every differing tensor had
    all its values recorded, so ``largest`` is the true largest difference, not a lower bound.
    """

    step: int
    tensors: int
    differing: int
    largest: float | None = None
    exact: bool = True
    nonfinite: bool = False
    first: str | None = None
    """The first differing tensor of the step, in words (``gradient of fc.weight``)."""


@dataclass(frozen=True)
class Series:
    """The distances of one later run against the first, step by step (every rank together)."""

    label: str
    points: tuple[StepDistance, ...]
    parted: int | None = None
    """The step from which the runs did different things (an event one has and the other not, or of
    another kind): nothing after it could be compared."""
    final: StepDistance | None = None
    """The state at exit (the ``final`` event), when both runs recorded one."""
    truncated: bool = False


class _Bucket:
    def __init__(self) -> None:
        self.tensors = 0
        self.differing = 0
        self.largest: float | None = None
        self.exact = True
        self.nonfinite = False
        self.first: str | None = None

    def add(self, a: dict[str, Any], b: dict[str, Any]) -> None:
        ta, tb = a.get("t") or [], b.get("t") or []
        self.tensors += max(len(ta), len(tb))
        if len(ta) != len(tb):
            self.differing += abs(len(ta) - len(tb))
            self.exact = False
        for i, (la, lb) in enumerate(zip(ta, tb, strict=False)):
            if la.get("fp") == lb.get("fp"):
                continue
            self.differing += 1
            if self.first is None:
                name = la.get("n")
                self.first = describe_name(name, a["kind"]) if isinstance(name, str) else f"tensor #{i}"
            largest, nonfinite, sampled = leaf_difference(la, lb)
            self.exact = self.exact and largest is not None and not sampled
            self.nonfinite = self.nonfinite or nonfinite
            if largest:  # None: nothing stored or unbounded; 0.0: the sampled values are equal
                self.largest = largest if self.largest is None else max(self.largest, largest)
        if a["fp"] != b["fp"] and self.differing == 0:  # same tensors, other structure or values
            self.differing = 1
            self.exact = False
            self.first = self.first or f"the {a['kind']} event of {a['key']}"

    def distance(self, step: int) -> StepDistance:
        return StepDistance(
            step=step,
            tensors=self.tensors,
            differing=self.differing,
            largest=self.largest,
            exact=self.exact and self.largest is not None,
            nonfinite=self.nonfinite,
            first=self.first,
        )


def _merge(a: StepDistance, b: StepDistance) -> StepDistance:
    """Two ranks' distances at one step as one."""
    largest = (
        a.largest if b.largest is None else b.largest if a.largest is None else max(a.largest, b.largest)
    )
    return StepDistance(
        step=a.step,
        tensors=a.tensors + b.tensors,
        differing=a.differing + b.differing,
        largest=largest,
        exact=(a.exact or a.differing == 0) and (b.exact or b.differing == 0) and largest is not None,
        nonfinite=a.nonfinite or b.nonfinite,
        first=a.first or b.first,
    )


def _rank_distances(
    ea: Sequence[dict[str, Any]], eb: Sequence[dict[str, Any]], *, invariant_only: bool
) -> tuple[list[StepDistance], int | None, StepDistance | None]:
    """One rank's distances per training step, the step the runs parted at (None: never) and the
    distance of the state at exit."""
    if invariant_only:
        ea = [e for e in ea if world_invariant(e["kind"], e["key"])]
        eb = [e for e in eb if world_invariant(e["kind"], e["key"])]
    optimizer = any(is_step(e["kind"], e["key"]) for e in ea)
    points: list[StepDistance] = []
    bucket = _Bucket()
    final: StepDistance | None = None
    parted: int | None = None
    seen = False  # whether the bucket holds an event
    for a, b in zip(ea, eb, strict=False):
        if (a["kind"], a["key"], a["step"]) != (b["kind"], b["key"], b["step"]):
            parted = points[-1].step + 1 if points else 0
            break
        if a["kind"] == "compute" and a["key"] == FINAL_KEY:
            last = _Bucket()
            last.add(a, b)
            final = last.distance(a["step"])
            continue
        bucket.add(a, b)
        seen = True
        if is_step(a["kind"], a["key"], backward=not optimizer):
            step = a["step"] if optimizer else a["step"] // 2  # backward() steps: two events each
            if points and points[-1].step == step:  # the gradients of a backward() step, then its update
                points[-1] = _merge(points[-1], bucket.distance(step))
            else:
                points.append(bucket.distance(step))
            bucket, seen = _Bucket(), False
    # one run having more events is a run stopped (or ended) earlier, not one that did other things
    if seen and parted is None and not points:  # events but no training step (records only)
        points.append(bucket.distance(0))
    return points, parted, final


def distance_series(
    run_a: str | os.PathLike[str], run_b: str | os.PathLike[str], *, label: str = "B vs A"
) -> Series:
    """How far run ``run_b`` is from ``run_a``, step by step, every rank together.

    Runs recorded on different numbers of processes are compared as ``compare`` does, in what does
    not depend on the split: rank 0 of each, in ``events.world_invariant`` events only.
    """
    return _series(runrecord.load_run(run_a), runrecord.load_run(run_b), label=label)


def _series(a: RunRecord, b: RunRecord, *, label: str) -> Series:
    """``distance_series`` of two loaded records."""
    ranks_a, ranks_b = sorted(a.events), sorted(b.events)
    invariant_only = ranks_a != ranks_b
    pairs = [(0, 0)] if invariant_only else [(r, r) for r in ranks_a]
    merged: dict[int, StepDistance] = {}
    parted: int | None = None
    final: StepDistance | None = None
    for ra, rb in pairs:
        points, rank_parted, rank_final = _rank_distances(
            a.events.get(ra, []), b.events.get(rb, []), invariant_only=invariant_only
        )
        for p in points:
            merged[p.step] = p if p.step not in merged else _merge(merged[p.step], p)
        if rank_parted is not None:
            parted = rank_parted if parted is None else min(parted, rank_parted)
        if rank_final is not None:
            final = rank_final if final is None else _merge(final, rank_final)
    steps = sorted(merged)
    if parted is not None:
        steps = [s for s in steps if s < parted]
    truncated = len(steps) > _MAX_POINTS
    return Series(
        label=label,
        points=tuple(merged[s] for s in steps[:_MAX_POINTS]),
        parted=parted,
        final=final,
        truncated=truncated,
    )


# --------------------------------------------------------------------------------------------
# What a report shows
# --------------------------------------------------------------------------------------------


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
        _series(first, record, label=f"run {i + 1} vs run 1")
        for i, record in enumerate(records[1:], start=1)
        if first is not None and record is not None
    ]
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


# --------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------

_COLORS = ("#c0392b", "#2471a3", "#7d3c98", "#1e8449", "#b9770e", "#566573")
_OUTCOME_COLORS = {
    Outcome.REPRODUCIBLE: "#1e8449",
    Outcome.DIVERGED: "#c0392b",
    Outcome.INCONCLUSIVE: "#b9770e",
    Outcome.FAILED: "#566573",
}

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1c2833;
  margin:0;background:#f4f6f7}
main{max-width:1000px;margin:0 auto;padding:24px}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:0 0 10px}
section{background:#fff;border:1px solid #d5dbdb;border-radius:6px;padding:16px 18px;margin:14px 0}
.badge{display:inline-block;color:#fff;font-weight:600;padding:3px 10px;border-radius:4px;
  letter-spacing:.03em}
pre,code{font:12.5px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{white-space:pre-wrap;word-break:break-word;background:#f8f9f9;border:1px solid #e5e8e8;
  border-radius:4px;padding:8px 10px;margin:6px 0}
table{border-collapse:collapse;width:100%}
td,th{text-align:left;padding:4px 8px;border-bottom:1px solid #eaeded;vertical-align:top}
th{color:#566573;font-weight:600;width:170px}
.src{border:1px solid #e5e8e8;border-radius:4px;background:#fbfcfc;overflow-x:auto}
.src div{white-space:pre;font:12.5px/1.5 ui-monospace,Menlo,Consolas,monospace;padding:0 8px}
.src div.hit{background:#fdebd0;font-weight:600}
.src span.n{color:#99a3a4;display:inline-block;width:44px}
.muted{color:#717d7e}.notes li{margin:3px 0}
svg text{font:11px system-ui,sans-serif;fill:#424949}
.legend span{display:inline-block;margin-right:16px}
.legend i{display:inline-block;width:10px;height:10px;border-radius:5px;margin-right:5px;
  vertical-align:-1px}
details summary{cursor:pointer;color:#2471a3}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


class _Plot:
    """The distance plot's geometry: steps on x; the largest difference (log) above, counts below."""

    W, LEFT, RIGHT = 920, 64, 16
    TOP, HEIGHT = 14, 190  # the difference panel
    BANDS = 34  # below it: rows for steps with no value difference (equal; differs, no value)
    GAP, COUNT_H, BOTTOM = 30, 90, 30  # the count panel and the x axis labels

    def __init__(self, series: Sequence[Series]) -> None:
        points = [p for s in series for p in s.points]
        self.steps = sorted({p.step for p in points})
        self.lo, self.hi = (self.steps[0], self.steps[-1]) if self.steps else (0, 1)
        diffs = [p.largest for p in points if p.largest is not None and p.largest > 0]
        self.d_lo = math.floor(math.log10(min(diffs))) if diffs else -8
        self.d_hi = math.ceil(math.log10(max(diffs))) if diffs else 0
        if self.d_hi <= self.d_lo:
            self.d_hi = self.d_lo + 1
        self.count_max = max([p.differing for p in points] + [1])
        self.count_top = self.TOP + self.HEIGHT + self.BANDS + self.GAP
        self.total_h = self.count_top + self.COUNT_H + self.BOTTOM

    def x(self, step: float) -> float:
        span = max(self.hi - self.lo, 1)
        return self.LEFT + (step - self.lo) / span * (self.W - self.LEFT - self.RIGHT - 10) + 5

    def y(self, diff: float) -> float:
        frac = (math.log10(diff) - self.d_lo) / (self.d_hi - self.d_lo)
        return self.TOP + self.HEIGHT * (1 - frac)

    def band(self, differs: bool) -> float:
        return self.TOP + self.HEIGHT + (24 if differs else 12)

    def count_y(self, n: int) -> float:
        return self.count_top + self.COUNT_H * (1 - n / self.count_max)


def _x_ticks(lo: int, hi: int) -> list[int]:
    span = max(hi - lo, 1)
    raw = span / 8
    mag = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    return list(range(int(start), hi + 1, int(step))) or [lo]


def _tooltip(label: str, p: StepDistance) -> str:
    if p.differing == 0:
        return f"{label}, step {p.step}: all {p.tensors} tensors equal"
    if p.nonfinite:
        how = "a difference that is not finite (NaN or infinity)"
    elif p.largest is None:
        how = "no recorded value differs (the differing values were not recorded)"
    else:
        how = f"largest |a-b| {p.largest:.3g}" + ("" if p.exact else " (at least: from sampled values)")
    first = f"; first: {p.first}" if p.first else ""
    return f"{label}, step {p.step}: {p.differing} of {p.tensors} tensors differ, {how}{first}"


def _svg(series: Sequence[Series]) -> str:
    plot = _Plot(series)
    out = [
        f'<svg id="distance-plot" xmlns="http://www.w3.org/2000/svg" '
        f'width="{plot.W}" height="{plot.total_h}" '
        f'viewBox="0 0 {plot.W} {plot.total_h}" role="img" aria-label="distance between the runs per step">'
    ]
    right = plot.W - plot.RIGHT
    # difference panel: decades
    for k in range(plot.d_lo, plot.d_hi + 1):
        y = plot.TOP + plot.HEIGHT * (1 - (k - plot.d_lo) / (plot.d_hi - plot.d_lo))
        out.append(f'<line x1="{plot.LEFT}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eaeded"/>')
        out.append(f'<text x="{plot.LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">1e{k}</text>')
    bottom = plot.TOP + plot.HEIGHT
    out.append(f'<line x1="{plot.LEFT}" x2="{plot.LEFT}" y1="{plot.TOP}" y2="{bottom}" stroke="#95a5a6"/>')
    for differs, label in ((False, "equal"), (True, "differs*")):
        y = plot.band(differs)
        out.append(f'<text x="{plot.LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
        out.append(f'<line x1="{plot.LEFT}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#f2f3f4"/>')
    mid = plot.TOP + plot.HEIGHT / 2
    out.append(
        f'<text x="14" y="{mid:.1f}" transform="rotate(-90 14 {mid:.1f})" '
        'text-anchor="middle">largest |a-b|</text>'
    )
    # count panel
    ct, cb = plot.count_top, plot.count_top + plot.COUNT_H
    out.append(f'<line x1="{plot.LEFT}" x2="{right}" y1="{cb}" y2="{cb}" stroke="#95a5a6"/>')
    out.append(f'<line x1="{plot.LEFT}" x2="{plot.LEFT}" y1="{ct}" y2="{cb}" stroke="#95a5a6"/>')
    out.append(f'<text x="{plot.LEFT - 6}" y="{ct + 4}" text-anchor="end">{plot.count_max}</text>')
    out.append(f'<text x="{plot.LEFT - 6}" y="{cb + 4}" text-anchor="end">0</text>')
    out.append(
        f'<text x="14" y="{(ct + cb) / 2:.1f}" transform="rotate(-90 14 {(ct + cb) / 2:.1f})" '
        'text-anchor="middle">tensors differing</text>'
    )
    for t in _x_ticks(plot.lo, plot.hi):
        x = plot.x(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{cb}" y2="{cb + 4}" stroke="#95a5a6"/>')
        out.append(f'<text x="{x:.1f}" y="{cb + 17}" text-anchor="middle">{t}</text>')
    out.append(f'<text x="{right}" y="{cb + 28}" text-anchor="end">training step</text>')
    n = max(len(series), 1)
    bar_w = max(1.0, min(10.0, (plot.W - plot.LEFT - plot.RIGHT) / max(len(plot.steps), 1) / n * 0.8))
    for si, s in enumerate(series):
        color = _COLORS[si % len(_COLORS)]
        label = _e(s.label)
        line = [f"{plot.x(p.step):.1f},{plot.y(p.largest):.1f}" for p in s.points if p.largest]
        if len(line) > 1:
            out.append(
                f'<polyline points="{" ".join(line)}" fill="none" stroke="{color}" '
                'stroke-width="1.2" opacity=".6"/>'
            )
        for p in s.points:
            x = plot.x(p.step)
            tip = _e(_tooltip(s.label, p))
            if p.largest is not None:
                y, cls, style = plot.y(p.largest), "point measured", f'fill="{color}"'
            elif p.differing:
                y, cls, style = (
                    plot.band(True),
                    "point differs",
                    f'fill="#fff" stroke="{color}" stroke-width="1.5"',
                )
            else:
                y, cls, style = (
                    plot.band(False),
                    "point equal",
                    'fill="#fff" stroke="#1e8449" stroke-width="1.2"',
                )
            out.append(
                f'<circle class="{cls}" data-series="{si}" data-step="{p.step}" '
                f'data-differing="{p.differing}" '
                f'cx="{x:.1f}" cy="{y:.1f}" r="3.2" {style}><title>{tip}</title></circle>'
            )
            if p.differing:
                bx = x - bar_w * n / 2 + bar_w * si
                by = plot.count_y(p.differing)
                out.append(
                    f'<rect class="bar" data-series="{si}" data-step="{p.step}" x="{bx:.1f}" y="{by:.1f}" '
                    f'width="{bar_w:.1f}" height="{cb - by:.1f}" fill="{color}" opacity=".75">'
                    f"<title>{tip}</title></rect>"
                )
        if s.parted is not None:
            x = plot.x(s.parted)
            out.append(
                f'<line class="parted" x1="{x:.1f}" x2="{x:.1f}" y1="{plot.TOP}" y2="{cb}" stroke="{color}" '
                f'stroke-dasharray="4 3"><title>{label}: the runs did different things from step {s.parted} '
                "on (an event one run has and the other has not)</title></line>"
            )
    out.append("</svg>")
    return "".join(out)


def _plot_section(series: Sequence[Series]) -> str:
    if not series or not any(s.points for s in series):
        return (
            '<section id="distance"><h2>How far the runs are apart</h2><p class="muted">No training step '
            "was recorded in both runs, so there is nothing to plot.</p></section>"
        )
    legend = "".join(
        f'<span><i style="background:{_COLORS[i % len(_COLORS)]}"></i>{_e(s.label)}</span>'
        for i, s in enumerate(series)
    )
    extra = []
    for s in series:
        first = next((p for p in s.points if p.differing), None)
        if first is None:
            extra.append(f"{_e(s.label)}: equal at all {len(s.points)} steps.")
        else:
            grown = [p.largest for p in s.points if p.largest is not None]
            size = ""
            if grown and max(grown) > grown[0]:
                size = f"; the largest difference grows from {grown[0]:.3g} to {max(grown):.3g}"
            elif grown:
                size = f"; largest difference {grown[0]:.3g}"
            extra.append(
                f"{_e(s.label)}: {len(s.points)} steps; first different at step {first.step}"
                f" ({first.differing} of {first.tensors} tensors){size}."
            )
        if s.parted is not None:
            extra.append(
                f"{_e(s.label)}: the runs did different things from step {s.parted}; not compared after."
            )
        if s.truncated:
            extra.append(f"{_e(s.label)}: plotted up to {_MAX_POINTS} steps.")
        if s.final is not None:
            state = (
                "equal"
                if s.final.differing == 0
                else f"{s.final.differing} of {s.final.tensors} tensors differ"
            )
            extra.append(f"{_e(s.label)}: state at exit: {state}.")
    rows = "".join(
        f"<tr><td>{_e(s.label)}</td><td>{p.step}</td><td>{p.differing} / {p.tensors}</td>"
        f"<td>{'not finite' if p.nonfinite else _fmt(p.largest)}"
        f"{'' if p.exact or p.largest is None else ' (≥)'}</td>"
        f"<td>{_e(p.first or '')}</td></tr>"
        for s in series
        for p in s.points
        if p.differing
    )
    table = (
        "<details><summary>the steps that differ, as a table</summary><table><tr><th>runs</th><th>step</th>"
        "<th>tensors differing</th><th>largest |a-b|</th><th>first differing</th></tr>"
        f"{rows}</table></details>"
        if rows
        else ""
    )
    return (
        '<section id="distance"><h2>How far the runs are apart, step by step</h2>'
        f'<div class="legend">{legend}</div>{_svg(series)}'
        '<p class="muted">Above: the largest absolute difference among the recorded values (every value of a '
        "tensor of at most 64 elements, 8 evenly spaced ones of a larger tensor: a lower bound), log scale. "
        '"equal": every tensor of the step is bit-identical; "differs*": tensors differ where no value was '
        "recorded. Below: how many tensors differ at the step. Hover a point for details.</p>"
        f"<ul>{''.join(f'<li>{t}</li>' for t in extra)}</ul>{table}</section>"
    )


def _divergence_section(data: ReportData) -> str:
    d = data.divergence
    if d is None:
        return ""
    rows = [
        ("where", data.divergence_text),
        ("step", d.get("step")),
        ("rank", d.get("rank")),
        ("kind", d.get("kind")),
        ("event", d.get("key")),
        ("tensor", d.get("what")),
        ("op", d.get("op")),
        ("module", d.get("module")),
        ("location", d.get("location")),
    ]
    t = data.tensor
    if t is not None:
        diff = "not finite" if t.get("nonfinite") else _fmt(t.get("max_abs_diff"))
        if t.get("max_abs_diff") is None and not t.get("nonfinite"):
            diff = "not stored (tensor too large)"
        rows.append(("largest |a-b|", diff))
    table = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows if v is not None)
    src = ""
    if data.source is not None:
        s = data.source
        lines = "".join(
            f'<div class="{"hit" if s.first + i == s.line else ""}">'
            f'<span class="n">{s.first + i}</span>{_e(text)}</div>'
            for i, text in enumerate(s.lines)
        )
        src = f'<p><code>{_e(s.path)}</code>, line {s.line}:</p><div class="src" id="source">{lines}</div>'
    elif d.get("location"):
        src = f'<p class="muted">The source of {_e(d["location"])} could not be read.</p>'
    return f'<section id="divergence"><h2>First divergence</h2><table>{table}</table>{src}</section>'


def _threads_html(t: dict[str, Any] | None) -> str:
    if t is None:
        return ""
    rows = [
        ("varied", t.get("varied")),
        ("op", t.get("op") or "not located"),
        ("location", t.get("location")),
    ]
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows if v is not None)
    values = t.get("values")
    result = ""
    if values and values[0] is not None and values[1] is not None:
        runs = t.get("runs", [1, 2])
        what = f"{t.get('tensor') or 'the first differing tensor'} {t.get('dtype')}{t.get('shape')}"
        sampled = " (evenly spaced sample of its values)" if t.get("sampled") else ""
        cells = "".join(
            f"<tr><td>{i}</td><td>{_e(repr(a))}</td><td>{_e(repr(b))}</td>"
            f"<td>{_fmt(abs(a - b)) if a != b else 'equal'}</td></tr>"
            for i, (a, b) in enumerate(zip(values[0], values[1], strict=False))
        )
        result = (
            f"<p>What the step computed under both settings: {_e(what)}{sampled}.</p><table>"
            f"<tr><th>#</th><th>run {runs[0]}</th><th>run {runs[1]}</th><th>|a-b|</th></tr>{cells}</table>"
        )
    op_result = ""
    if t.get("repro_output"):
        op_result = (
            f"<p>The op itself, called on its saved inputs under both thread counts (the standalone "
            f"script <code>{_e(t.get('repro_script'))}</code>, run in a fresh process):</p>"
            f'<pre id="op-result">{_e(t["repro_output"].strip())}</pre>'
        )
    return f'<section id="threads"><h2>Thread count</h2><table>{body}</table>{op_result}{result}</section>'


def _environment_section(data: ReportData) -> str:
    parts = []
    if data.settings:
        parts.append("<h3>How the runs were started differently</h3><ul>")
        parts.extend(f"<li>{_e(s)}</li>" for s in data.settings)
        parts.append("</ul>")
    if data.commands:
        parts.append("<h3>Command lines</h3>")
        parts.extend(f"<pre>{_e(' '.join(c))}</pre>" for c in data.commands)
    shown = [d for d in data.environment if not d.get("volatile")]
    hidden = [d for d in data.environment if d.get("volatile")]

    def table(rows: Sequence[dict[str, Any]]) -> str:
        cells = "".join(
            f"<tr><td><code>{_e(d.get('key'))}</code>{' <b>!</b>' if d.get('breaks') else ''}</td>"
            f"<td>{_e(d.get('a'))}</td><td>{_e(d.get('b'))}</td><td>{_e(d.get('reason') or '')}</td></tr>"
            for d in rows
        )
        head = "<tr><th>setting</th><th>run A</th><th>run B</th><th>why it matters</th></tr>"
        return f"<table>{head}{cells}</table>"

    if shown:
        parts.append("<h3>Environment differences</h3>" + table(shown))
    elif data.environment or data.records:
        parts.append('<p class="muted">No environment difference that matters.</p>')
    if hidden:
        parts.append(
            f"<details><summary>{len(hidden)} difference(s) every two records have (when and where each "
            f"was recorded)</summary>{table(hidden)}</details>"
        )
    if not parts:
        return ""
    return '<section id="environment"><h2>Environment and command line</h2>' + "".join(parts) + "</section>"


def render_report(data: ReportData) -> str:
    """The report page of ``data``: one self-contained HTML document."""
    color = _OUTCOME_COLORS[Outcome(data.outcome)]
    headline = "\n".join(data.headline)
    notes = "".join(f"<li>{_e(n)}</li>" for n in data.notes)
    error = ""
    if data.error is not None:
        tail = f"<pre>{_e(data.stderr_tail)}</pre>" if data.stderr_tail else ""
        error = f'<section id="error"><h2>The script failed</h2><p>{_e(data.error)}</p>{tail}</section>'
    payload = json.dumps(data.to_dict(), allow_nan=False, default=str)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):  # inert in <script>
        payload = payload.replace(char, escaped)
    records = "".join(f"<code>{_e(r)}</code> " for r in data.records)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="generator" content="{GENERATOR}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(data.title)}</title><style>{_CSS}</style></head><body><main>"
        f'<header><h1>{_e(data.title)}</h1><span class="badge" id="status" style="background:{color}">'
        f"{_e(data.status.upper())}</span></header>"
        f'<section id="verdict"><h2>Verdict</h2><pre>{_e(headline)}</pre>'
        + (f"<p>Command: <code>{_e(' '.join(data.command))}</code></p>" if data.command else "")
        + f'<p class="muted">Records: {records}</p></section>'
        + error
        + _divergence_section(data)
        + _threads_html(data.threads)
        + (_plot_section(data.series) if data.error is None else "")
        + _environment_section(data)
        + (f'<section id="notes"><h2>Notes</h2><ul class="notes">{notes}</ul></section>' if notes else "")
        + f'<script type="application/json" id="torchrepro-data">{payload}</script>'
        + "</main></body></html>\n"
    )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def check_report_path(path: str | os.PathLike[str]) -> Path:
    """``path`` if a report may be written there: its directory exists and it is not a directory
    or a file other than an earlier torchrepro report; else ``SettingsError`` saying what to do."""
    out = Path(path)
    if out.is_dir():
        raise SettingsError(
            f"--report {os.fspath(path)!r} is a directory: give a file name, e.g. {out / 'report.html'}"
        )
    parent = out.parent if os.fspath(out.parent) else Path(".")
    if not parent.is_dir():
        raise SettingsError(
            f"--report {os.fspath(path)!r}: the directory {os.fspath(parent)!r} does not exist; "
            "create it first"
        )
    if out.exists():
        try:
            with open(out, "rb") as f:
                head = f.read(4096)
        except OSError as exc:
            raise SettingsError(f"--report {os.fspath(path)!r} cannot be read: {exc}") from None
        if f'<meta name="generator" content="{GENERATOR}">'.encode() not in head:
            raise SettingsError(
                f"--report {os.fspath(path)!r} exists and is not a torchrepro report: it is left as it is; "
                "give another file name"
            )
    return out


def _write(path: str | os.PathLike[str], data: ReportData) -> Path:
    out = check_report_path(path)
    atomic_write_bytes(out, render_report(data).encode("utf-8"))
    return out


def write_check_report(path: str | os.PathLike[str], result: CheckResult) -> Path:
    """Write the HTML report of ``result`` to ``path``; return it."""
    return _write(path, check_report_data(result))


def write_compare_report(
    path: str | os.PathLike[str],
    result: Comparison,
    run_a: str | os.PathLike[str],
    run_b: str | os.PathLike[str],
) -> Path:
    """Write the HTML report of ``compare run_a run_b`` (``result``) to ``path``; return it."""
    return _write(path, compare_report_data(result, run_a, run_b))
