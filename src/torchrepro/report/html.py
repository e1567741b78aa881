"""The report page itself: one self-contained HTML file, written atomically and never over a file
that is not a torchrepro report.

Invariants: inline CSS and SVG, no script that runs, no font, image or link that loads anything
(it opens offline and from an attachment); the data are embedded as JSON
(``<script type="application/json" id="torchrepro-data">``); every text from a record or the user's
source is escaped; ``check_report_path`` refuses a path it may not write before a check starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrepro._io import atomic_write_bytes
from torchrepro.errors import SettingsError
from torchrepro.results import Outcome

if TYPE_CHECKING:
    from torchrepro.results import CheckResult, Comparison
from torchrepro.report.data import ReportData, check_report_data, compare_report_data
from torchrepro.report.distances import MAX_POINTS, Series
from torchrepro.report.svg import SERIES_COLORS, distance_svg, escape, number

__all__ = ["GENERATOR", "check_report_path", "render_report", "write_check_report", "write_compare_report"]


GENERATOR = "torchrepro report"
"""The ``<meta name="generator">`` of every report: a file holding it may be written over."""


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


def _plot_section(series: Sequence[Series], marks: Sequence[tuple[int, str]] = ()) -> str:
    if not series or not any(s.points for s in series):
        return (
            '<section id="distance"><h2>How far the runs are apart</h2><p class="muted">No training step '
            "was recorded in both runs, so there is nothing to plot.</p></section>"
        )
    legend = "".join(
        f'<span><i style="background:{SERIES_COLORS[i % len(SERIES_COLORS)]}"></i>{escape(s.label)}</span>'
        for i, s in enumerate(series)
    )
    extra = []
    for s in series:
        first = next((p for p in s.points if p.differing), None)
        if first is None:
            extra.append(f"{escape(s.label)}: equal at all {len(s.points)} steps.")
        else:
            grown = [p.largest for p in s.points if p.largest is not None]
            size = ""
            if grown and max(grown) > grown[0]:
                size = f"; the largest difference grows from {grown[0]:.3g} to {max(grown):.3g}"
            elif grown:
                size = f"; largest difference {grown[0]:.3g}"
            extra.append(
                f"{escape(s.label)}: {len(s.points)} steps; first different at step {first.step}"
                f" ({first.differing} of {first.tensors} tensors){size}."
            )
        if s.parted is not None:
            extra.append(
                f"{escape(s.label)}: the runs did different things from step {s.parted}; not compared after."
            )
        if s.truncated:
            extra.append(f"{escape(s.label)}: plotted up to {MAX_POINTS} steps.")
        if s.final is not None:
            state = (
                "equal"
                if s.final.differing == 0
                else f"{s.final.differing} of {s.final.tensors} tensors differ"
            )
            extra.append(f"{escape(s.label)}: state at exit: {state}.")
    rows = "".join(
        f"<tr><td>{escape(s.label)}</td><td>{p.step}</td><td>{p.differing} / {p.tensors}</td>"
        f"<td>{'not finite' if p.nonfinite else number(p.largest)}"
        f"{'' if p.exact or p.largest is None else ' (≥)'}</td>"
        f"<td>{escape(p.first or '')}</td></tr>"
        for s in series
        for p in s.points
        if p.differing
    )
    marked = (
        [
            f"The dashed grey line{'s' if len(marks) > 1 else ''} mark{'' if len(marks) > 1 else 's'}: "
            + "; ".join(escape(text) for _, text in marks)
            + "."
        ]
        if marks
        else []
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
        f'<div class="legend">{legend}</div>{distance_svg(series, marks)}'
        '<p class="muted">Above: the largest absolute difference among the recorded values (every value of a '
        "tensor of at most 64 elements, 8 evenly spaced ones of a larger tensor: a lower bound), log scale. "
        '"equal": every tensor of the step is bit-identical; "differs*": tensors differ where no value was '
        "recorded. Below: how many tensors differ at the step. Hover a point for details.</p>"
        f"<ul>{''.join(f'<li>{t}</li>' for t in [*extra, *marked])}</ul>{table}</section>"
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
        diff = "not finite" if t.get("nonfinite") else number(t.get("max_abs_diff"))
        if t.get("max_abs_diff") is None and not t.get("nonfinite"):
            diff = "not stored (tensor too large)"
        rows.append(("largest |a-b|", diff))
    table = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows if v is not None)
    src = ""
    if data.source is not None:
        s = data.source
        lines = "".join(
            f'<div class="{"hit" if s.first + i == s.line else ""}">'
            f'<span class="n">{s.first + i}</span>{escape(text)}</div>'
            for i, text in enumerate(s.lines)
        )
        src = (
            f'<p><code>{escape(s.path)}</code>, line {s.line}:</p><div class="src" id="source">{lines}</div>'
        )
    elif d.get("location"):
        src = f'<p class="muted">The source of {escape(d["location"])} could not be read.</p>'
    return f'<section id="divergence"><h2>First divergence</h2><table>{table}</table>{src}</section>'


def _threads_html(t: dict[str, Any] | None) -> str:
    if t is None:
        return ""
    rows = [
        ("varied", t.get("varied")),
        ("op", t.get("op") or "not located"),
        ("location", t.get("location")),
    ]
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows if v is not None)
    values = t.get("values")
    result = ""
    if values and values[0] is not None and values[1] is not None:
        runs = t.get("runs", [1, 2])
        what = f"{t.get('tensor') or 'the first differing tensor'} {t.get('dtype')}{t.get('shape')}"
        sampled = " (evenly spaced sample of its values)" if t.get("sampled") else ""
        cells = "".join(
            f"<tr><td>{i}</td><td>{escape(repr(a))}</td><td>{escape(repr(b))}</td>"
            f"<td>{number(abs(a - b)) if a != b else 'equal'}</td></tr>"
            for i, (a, b) in enumerate(zip(values[0], values[1], strict=False))
        )
        result = (
            f"<p>What the step computed under both settings: {escape(what)}{sampled}.</p><table>"
            f"<tr><th>#</th><th>run {runs[0]}</th><th>run {runs[1]}</th><th>|a-b|</th></tr>{cells}</table>"
        )
    op_result = ""
    if t.get("repro_output"):
        op_result = (
            f"<p>The op itself, called on its saved inputs under both thread counts (the standalone "
            f"script <code>{escape(t.get('repro_script'))}</code>, run in a fresh process):</p>"
            f'<pre id="op-result">{escape(t["repro_output"].strip())}</pre>'
        )
    return f'<section id="threads"><h2>Thread count</h2><table>{body}</table>{op_result}{result}</section>'


def _environment_section(data: ReportData) -> str:
    parts = []
    if data.settings:
        parts.append("<h3>How the runs were started differently</h3><ul>")
        parts.extend(f"<li>{escape(s)}</li>" for s in data.settings)
        parts.append("</ul>")
    if data.commands:
        parts.append("<h3>Command lines</h3>")
        parts.extend(f"<pre>{escape(' '.join(c))}</pre>" for c in data.commands)
    shown = [d for d in data.environment if not d.get("volatile")]
    hidden = [d for d in data.environment if d.get("volatile")]

    def table(rows: Sequence[dict[str, Any]]) -> str:
        cells = "".join(
            f"<tr><td><code>{escape(d.get('key'))}</code>{' <b>!</b>' if d.get('breaks') else ''}</td>"
            f"<td>{escape(d.get('a'))}</td><td>{escape(d.get('b'))}</td>"
            f"<td>{escape(d.get('reason') or '')}</td></tr>"
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
    notes = "".join(f"<li>{escape(n)}</li>" for n in data.notes)
    error = ""
    if data.error is not None:
        tail = f"<pre>{escape(data.stderr_tail)}</pre>" if data.stderr_tail else ""
        error = f'<section id="error"><h2>The script failed</h2><p>{escape(data.error)}</p>{tail}</section>'
    payload = json.dumps(data.to_dict(), allow_nan=False, default=str)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):  # inert in <script>
        payload = payload.replace(char, escaped)
    records = "".join(f"<code>{escape(r)}</code> " for r in data.records)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="generator" content="{GENERATOR}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(data.title)}</title><style>{_CSS}</style></head><body><main>"
        f'<header><h1>{escape(data.title)}</h1><span class="badge" id="status" style="background:{color}">'
        f"{escape(data.status.upper())}</span></header>"
        f'<section id="verdict"><h2>Verdict</h2><pre>{escape(headline)}</pre>'
        + (f"<p>Command: <code>{escape(' '.join(data.command))}</code></p>" if data.command else "")
        + f'<p class="muted">Records: {records}</p></section>'
        + error
        + _divergence_section(data)
        + _threads_html(data.threads)
        + (_plot_section(data.series, data.marks) if data.error is None else "")
        + _environment_section(data)
        + (f'<section id="notes"><h2>Notes</h2><ul class="notes">{notes}</ul></section>' if notes else "")
        + f'<script type="application/json" id="torchrepro-data">{payload}</script>'
        + "</main></body></html>\n"
    )


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
