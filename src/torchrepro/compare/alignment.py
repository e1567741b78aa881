"""Aligning two runs' events, rank by rank: where they first part, and what was compared.

Invariants:
- Two runs agree at an event iff their events at the same position on the same rank have the
  same ``kind``, ``key``, ``step`` and fingerprint; the first divergence of a rank is the first
  position where they do not (a missing event where the other run has one counts). Its ``kind``
  is that of the first run's event there, unless the two runs did different things (another
  kind or key) and the second run's event has the earlier step: then it is that event's.
- A ``RankCursor`` reads live lists as they grow (``check``) or whole records (``compare``).
- Runs on different numbers of processes are compared in the events that must not depend on how
  a global batch is split (``events.world_invariant``; the state at exit stepped by optimizer
  steps, not by ``backward()`` calls): rank 0 of the run on fewer processes against every rank of
  the other (``world_cursor``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchrepro.events import (
    FINAL_KEY,
    counted_kind,
    is_optimizer_key,
    optimizer_index,
    optimizer_key,
    world_invariant,
)
from torchrepro.results import (
    Coverage,
    Divergence,
)

__all__ = [
    "RankCursor",
    "coverage",
    "event_divergence",
    "first_divergence",
    "optimizer_steps",
    "steps_compared",
    "world_cursor",
]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(
        a["kind"] == b["kind"] and a["key"] == b["key"] and a["step"] == b["step"] and a["fp"] == b["fp"]
    )


class _WorldEvents(Sequence[dict[str, Any]]):
    """The events of one rank that must not depend on the world size (``events.world_invariant``),
    read as a live list grows. The state at exit is stepped by the optimizer steps before it (its
    recorded step counts ``backward()`` calls when no optimizer stepped: one per micro-batch)."""

    def __init__(self, events: Sequence[dict[str, Any]]) -> None:
        self._events = events
        self._kept: list[dict[str, Any]] = []
        self._read = 0
        self._steps = 0  # optimizer steps of the first optimizer read so far

    def _catch_up(self) -> list[dict[str, Any]]:
        while self._read < len(self._events):
            event = self._events[self._read]
            self._read += 1
            kind, key = str(event["kind"]), event.get("key")
            if not world_invariant(kind, key):
                continue
            if kind == "compute" and key == optimizer_key(0):
                self._steps += 1
            elif counted_kind(kind, key) == FINAL_KEY:
                event = {**event, "step": self._steps}
            self._kept.append(event)
        return self._kept

    def __len__(self) -> int:
        return len(self._catch_up())

    def __getitem__(self, i: Any) -> Any:
        return self._catch_up()[i]


class RankCursor:
    """Compares one rank of two runs event by event as the events arrive (``a`` and ``b`` may
    grow between calls; ``world_cursor`` gives it views of them)."""

    def __init__(self, rank: int, a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> None:
        self.rank = rank
        self.a = a
        self.b = b
        self.position = 0
        self.divergence: Divergence | None = None
        self.max_step_compared = -1
        self.compared: dict[str, int] = {}
        """Events compared so far, per kind (the diverging one included; the ``compute`` event of
        the state at exit counts as ``final``)."""
        self.optimizer_steps: dict[str, int] = {}
        """Optimizer steps compared so far, per optimizer key (the diverging one included)."""

    def advance(self, *, a_done: bool = False, b_done: bool = False) -> Divergence | None:
        """Compare every event both sides now have; with ``*_done`` a missing event diverges."""
        while self.divergence is None:
            i = self.position
            has_a, has_b = i < len(self.a), i < len(self.b)
            if has_a and has_b:
                ea, eb = self.a[i], self.b[i]
                counted = counted_kind(ea["kind"], ea["key"])
                self.compared[counted] = self.compared.get(counted, 0) + 1
                if counted == "compute":
                    self.max_step_compared = max(self.max_step_compared, ea["step"])
                    if is_optimizer_key(ea["key"]):
                        self.optimizer_steps[ea["key"]] = self.optimizer_steps.get(ea["key"], 0) + 1
                if not _same(ea, eb):
                    self.divergence = event_divergence(ea, eb, self.rank, i)
                    break
                self.position += 1
            elif has_a and b_done:
                self.divergence = event_divergence(self.a[i], None, self.rank, i)
            elif has_b and a_done:
                self.divergence = event_divergence(None, self.b[i], self.rank, i)
            else:
                break
        return self.divergence


def event_divergence(a: dict[str, Any] | None, b: dict[str, Any] | None, rank: int, index: int) -> Divergence:
    """The divergence of event ``a`` of the first run and ``b`` of the other at ``index`` of
    ``rank`` (None: that run has no event there): its kind, step, key and first differing tensor."""
    event = a if a is not None else b
    assert event is not None
    kind, step = event["kind"], event["step"]
    # The runs did different things here: report the earlier of the two in step order.
    different = a is not None and b is not None and (a["kind"], a["key"]) != (b["kind"], b["key"])
    if different and b is not None and b["step"] < step:
        kind, step, event = b["kind"], b["step"], b
    name = shape = dtype = None
    if a is not None and b is not None and not different:
        leaf = _first_differing_leaf(a, b)
        if leaf is not None:
            name, shape, dtype = leaf.get("n", ""), tuple(leaf["shape"]), str(leaf["dtype"])
    source = event.get("src") if kind == "data" else None
    return Divergence(
        step=int(step),
        rank=rank,
        kind=str(kind),
        key=str(event["key"]),
        index=index,
        location=source if isinstance(source, str) else None,
        name=name,
        shape=shape,
        dtype=dtype,
        unmatched=a is None or b is None or different,
    )


def _first_differing_leaf(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """The first tensor entry of ``a`` that differs from ``b``'s (by fingerprint or structure)."""
    ta, tb = a.get("t", []), b.get("t", [])
    for la, lb in zip(ta, tb, strict=False):
        if la["fp"] != lb["fp"] or la.get("n") != lb.get("n"):
            return dict(la)
    if len(ta) > len(tb):
        return dict(ta[len(tb)])
    return None


def first_divergence(a: list[dict[str, Any]], b: list[dict[str, Any]], *, rank: int = 0) -> Divergence | None:
    """The first divergence between two complete event lists of one rank (None: identical)."""
    return RankCursor(rank, a, b).advance(a_done=True, b_done=True)


def world_cursor(rank: int, a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> RankCursor:
    """A cursor comparing two runs on different numbers of processes in the events that must not
    depend on the world size: one side is rank 0 of the run on fewer processes, the other rank
    ``rank`` of the run on more (``WorldScope``); ``position`` counts those events."""
    return RankCursor(rank, _WorldEvents(a), _WorldEvents(b))


def coverage(cursors: Sequence[RankCursor], ranks_expected: Sequence[int]) -> Coverage:
    """The coverage of a comparison: events compared per rank (summed over the compared run pairs)."""
    per_rank: dict[int, dict[str, int]] = {}
    for cursor in cursors:
        counts = per_rank.setdefault(cursor.rank, {})
        for kind, n in cursor.compared.items():
            counts[kind] = counts.get(kind, 0) + n
    return Coverage(per_rank=per_rank, ranks_expected=tuple(sorted(ranks_expected)))


def steps_compared(cursors: list[RankCursor]) -> int:
    """Optimizer steps compared: the highest compute step index reached on any rank, plus one."""
    return max((c.max_step_compared for c in cursors), default=-1) + 1


def optimizer_steps(cursors: Sequence[RankCursor]) -> dict[str, int]:
    """Optimizer steps compared per optimizer key, in optimizer order: the most any rank (and pair
    of runs) compared, so two optimizers stepping 20 times each are ``{"optimizer0": 20,
    "optimizer1": 20}``."""
    found: dict[str, int] = {}
    for cursor in cursors:
        for key, n in cursor.optimizer_steps.items():
            found[key] = max(found.get(key, 0), n)
    return {key: found[key] for key in sorted(found, key=optimizer_index)}
