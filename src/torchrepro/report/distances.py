"""How far two runs are apart, step by step: the distance series a report plots.

Invariants: one point per compared training step of every series (a later run against the first,
all ranks together): the tensors compared and differing, and the largest absolute difference
among the recorded values (every value of a tensor of at most 64 elements, the recorder's evenly
spaced sample of a larger floating one: a lower bound); runs that did different things are
compared up to the step they parted at, and a series stops at ``MAX_POINTS`` steps, saying so.
Runs on different numbers of processes are compared as ``compare`` does: rank 0 of each, in
``events.world_invariant`` events only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchrepro import runrecord
from torchrepro.compare.differences import leaf_difference
from torchrepro.compare.resume import step_segments
from torchrepro.events import FINAL_KEY, describe_name, is_step, world_invariant
from torchrepro.runrecord import RunRecord

if TYPE_CHECKING:
    pass

__all__ = ["MAX_POINTS", "Series", "StepDistance", "distance_series", "record_series", "resumed_record"]


MAX_POINTS = 5000  # steps plotted per series (a longer run is plotted up to there, and says so)


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


def _stitched(
    ea: Sequence[dict[str, Any]], eb: Sequence[dict[str, Any]], restored_at: int
) -> list[dict[str, Any]]:
    """One rank of a restarted run as if it had run from the start: the first run's events of its
    first ``restored_at`` steps, then the restart's, each step's events matched with the first
    run's of step ``restored_at + s`` by kind, from the end (a restart may read extra batches
    before its first step), and numbered as those. Stops where a step has fewer events."""
    seg_a, tail_a = step_segments(ea)
    seg_b, tail_b = step_segments(eb)
    out = [e for seg in seg_a[:restored_at] for e in seg]
    for s, n in enumerate(range(restored_at, len(seg_a))):
        if s >= len(seg_b):
            return out
        queues: dict[str, list[dict[str, Any]]] = {}
        for kind in {e["kind"] for e in seg_a[n]}:
            want = sum(1 for e in seg_a[n] if e["kind"] == kind)
            have = [e for e in seg_b[s] if e["kind"] == kind]
            if len(have) < want:
                return out
            queues[kind] = have[len(have) - want :]
        for a in seg_a[n]:
            b = queues[a["kind"]].pop(0)
            key = a["key"] if a["kind"] == "data" else b["key"]  # loaders compared by content
            out.append({**b, "key": key, "step": a["step"]})
    if len(seg_b) == len(seg_a) - restored_at:  # both ran to their end: the states at exit too

        def finals(tail: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [e for e in tail if e["kind"] == "compute" and e["key"] == FINAL_KEY]

        out.extend({**b, "step": a["step"]} for a, b in zip(finals(tail_a), finals(tail_b), strict=False))
    return out


def resumed_record(first: RunRecord, restarted: RunRecord, restored_at: int) -> RunRecord:
    """``restarted`` (a run started again after a kill, ``check --vary resume``) stitched onto the
    first run's first ``restored_at`` steps, so ``record_series`` plots it against the first run."""
    events = {r: _stitched(first.events.get(r, []), eb, restored_at) for r, eb in restarted.events.items()}
    return RunRecord(path=restarted.path, events=events, env=restarted.env, settings=restarted.settings)


def distance_series(
    run_a: str | os.PathLike[str], run_b: str | os.PathLike[str], *, label: str = "B vs A"
) -> Series:
    """How far run ``run_b`` is from ``run_a``, step by step, every rank together.

    Runs recorded on different numbers of processes are compared as ``compare`` does, in what does
    not depend on the split: rank 0 of each, in ``events.world_invariant`` events only.
    """
    return record_series(runrecord.load_run(run_a), runrecord.load_run(run_b), label=label)


def record_series(a: RunRecord, b: RunRecord, *, label: str) -> Series:
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
    truncated = len(steps) > MAX_POINTS
    return Series(
        label=label,
        points=tuple(merged[s] for s in steps[:MAX_POINTS]),
        parted=parted,
        final=final,
        truncated=truncated,
    )
