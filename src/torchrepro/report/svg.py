"""The distance plot as inline SVG: bars of the tensors differing, a log scale of the largest
difference, every text escaped; no script, no font, nothing loaded."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from torchrepro.report.distances import Series, StepDistance

__all__ = ["SERIES_COLORS", "Plot", "distance_svg", "escape", "number", "tooltip"]


SERIES_COLORS = ("#c0392b", "#2471a3", "#7d3c98", "#1e8449", "#b9770e", "#566573")


def escape(value: Any) -> str:
    return html.escape(str(value), quote=True)


def number(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


class Plot:
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


def tooltip(label: str, p: StepDistance) -> str:
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


def distance_svg(series: Sequence[Series], marks: Sequence[tuple[int, str]] = ()) -> str:
    """The plot of ``series``; ``marks``: ``(step, label)`` drawn as labelled dashed lines."""
    plot = Plot(series)
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
        color = SERIES_COLORS[si % len(SERIES_COLORS)]
        label = escape(s.label)
        line = [f"{plot.x(p.step):.1f},{plot.y(p.largest):.1f}" for p in s.points if p.largest]
        if len(line) > 1:
            out.append(
                f'<polyline points="{" ".join(line)}" fill="none" stroke="{color}" '
                'stroke-width="1.2" opacity=".6"/>'
            )
        for p in s.points:
            x = plot.x(p.step)
            tip = escape(tooltip(s.label, p))
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
    for i, (step, text) in enumerate(marks):
        x = plot.x(step)
        out.append(
            f'<line class="mark" data-step="{step}" x1="{x:.1f}" x2="{x:.1f}" y1="{plot.TOP}" '
            f'y2="{plot.count_top + plot.COUNT_H}" stroke="#7f8c8d" stroke-dasharray="2 3">'
            f"<title>{escape(text)}</title></line>"
            f'<text class="mark" x="{x + 3:.1f}" y="{plot.TOP + 10 + 12 * i}" fill="#7f8c8d">'
            f"{escape(text)}</text>"
        )
    out.append("</svg>")
    return "".join(out)
