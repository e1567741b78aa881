"""Locating a ``compute`` divergence in the op traces of its step: the op, module, line and rank.

Invariants: one code path for ``torchrepro check`` (traced re-runs) and ``torchrepro compare``
(recorded traces); traces that could not be compared are named, never taken as matching; among
ranks the source is an op that is not a collective, preferably on the divergence's rank; an op
whose inputs are equal and whose output differs under a setting varied on purpose is explained
by that setting. The trace comparison (``tracing.compare``) is imported only when there are
traces to compare.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torchrepro.results import Divergence

__all__ = ["locate_in_traces"]


def locate_in_traces(
    first: Divergence,
    traces: Sequence[tuple[int, str | os.PathLike[str], str | os.PathLike[str]]],
    *,
    varied: str | None = None,
) -> tuple[Divergence | None, list[str], list[int]]:
    """Compare per-rank op traces ``(rank, trace_a, trace_b)`` of the step ``first`` diverged at.

    Returns ``first`` with ``op``, ``module``, ``location`` and ``rank`` of the source op filled
    (None when no pair of traces differs), notes on what went wrong or what the op did, and the
    ranks whose traces could not be compared (unreadable: never to be taken as matching).
    Among ranks, the source is an op that is not a collective, preferably on ``first.rank``.
    ``varied`` says how the two runs were started differently on purpose (``check --vary``, e.g.
    "with 1 thread in run 1 and 2 threads in run 2"): an op whose inputs are equal and whose output
    differs is then explained by that setting, not called nondeterministic.
    """
    from torchrepro.tracing.compare import compare_traces
    from torchrepro.tracing.ops import OpDivergence

    notes: list[str] = []
    failed: list[int] = []
    located: list[tuple[int, OpDivergence]] = []
    for r, ta, tb in traces:
        try:
            d = compare_traces(ta, tb)
        except Exception as exc:
            notes.append(f"comparing the op traces of rank {r} failed: {type(exc).__name__}: {exc}")
            failed.append(r)
            continue
        if d is not None:
            located.append((r, d))
    if not located:
        return None, notes, failed
    r, d = _pick_source(located, prefer_rank=first.rank)
    if varied is not None and d.inputs_equal:
        notes.append(
            f"source op {d.op}: every input is bitwise equal but its output differs {varied}: "
            "the op's result depends on that setting (e.g. a reduction split across threads), "
            "not on randomness"
        )
    elif d.note:
        notes.append(f"source op {d.op}: {d.note}")
    return replace(first, rank=r, op=d.op, module=d.module, location=d.location), notes, failed


def _pick_source(located: list[tuple[int, Any]], *, prefer_rank: int) -> tuple[int, Any]:
    """Among per-rank op divergences, the source: not a collective, else the preferred rank."""

    def is_collective(d: Any) -> bool:
        op = str(getattr(d, "op", "") or "")
        return "c10d" in op or "all_reduce" in op or "allreduce" in op

    non_collective = [(r, d) for r, d in located if not is_collective(d)]
    pool = non_collective or located
    for r, d in pool:
        if r == prefer_rank:
            return r, d
    return pool[0]
