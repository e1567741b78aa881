"""``compare_runs``: two recorded runs (say, from two machines), their first divergence and why.

Invariants:
- Records are read through ``runrecord``; every rank either run recorded, or that the larger world
  should have, is compared (a missing rank diverges).
- Across ranks the reported divergence is the earliest among the ranks' first divergences by the
  one rule ``events.divergence_order``, which ``check`` uses too.
- A ``compute`` divergence at step k is located (op, module, line, rank) from op traces of step k
  (``trace-step<k>.rank<R>``, written by ``torchrepro run --trace-step k``) through
  ``tracing.locate``, shared with ``torchrepro check``; locating never changes the verdict.
- Whether the runs are reproducible, diverged or inconclusive is decided by ``verdict``'s rules,
  the ones ``check`` uses.
"""

from __future__ import annotations

import os

from torchrepro.compare.alignment import RankCursor, coverage, optimizer_steps, steps_compared, world_cursor
from torchrepro.compare.differences import tensor_difference
from torchrepro.compare.settings import (
    env_difference_dict,
    environment_differences,
    node_notes,
    setting_differences,
    unrecorded_notes,
    varied_threads,
)
from torchrepro.events import (
    earliest,
    optimizer_index,
)
from torchrepro.results import (
    Comparison,
    Divergence,
    WorldScope,
    processes,
)
from torchrepro.runrecord import (
    RunRecord,
    load_run,
    read_world,
)
from torchrepro.tracing.locate import locate_in_traces
from torchrepro.verdict import (
    FINAL_NOT_LOCATED,
    WORLD_NOT_LOCATED,
    describe_setting,
    final_state_reason,
    inconclusive_verdict,
    world_divergence_reason,
)

__all__ = ["compare_runs"]


def compare_runs(run_a: str | os.PathLike[str], run_b: str | os.PathLike[str]) -> Comparison:
    """Compare two recorded runs (say, from two machines): first divergence and env differences."""
    a, b = load_run(run_a), load_run(run_b)
    sizes = (_world_size(a), _world_size(b))
    world = None if sizes[0] == sizes[1] else WorldScope(min(sizes), max(sizes))
    cursors: dict[int, RankCursor] = {}
    world_notes: list[str] = []
    if world is None:
        for rank in sorted(set(a.events) | set(b.events)):
            cursors[rank] = RankCursor(rank, a.events.get(rank, []), b.events.get(rank, []))
    else:  # rank 0 of the run on fewer processes against every rank of the other
        smaller, larger = (a, b) if sizes[0] < sizes[1] else (b, a)
        for rank in sorted(set(larger.events) | set(range(world.other))):  # a missing rank diverges
            pair = (smaller.events.get(0, []), larger.events.get(rank, []))
            cursors[rank] = world_cursor(rank, *(pair if smaller is a else pair[::-1]))
        world_notes.append(f"compared {world.describe()}")
        others = sorted(r for r in smaller.events if r != 0)
        if others:
            world_notes.append(
                f"rank(s) {', '.join(map(str, others))} of the run on {processes(world.reference)} were "
                "not compared (its rank 0 stands for it)"
            )
    found = [d for d in (c.advance(a_done=True, b_done=True) for c in cursors.values()) if d is not None]
    first = earliest(found)
    tensor = None
    if first is not None:
        ea, eb = cursors[first.rank].a, cursors[first.rank].b
        if first.index < len(ea) and first.index < len(eb):
            tensor = tensor_difference(ea[first.index], eb[first.index])
    started = setting_differences(a, b)
    unrecorded = unrecorded_notes(a, b)
    env_differences, notes = environment_differences(a, b)
    notes = world_notes + unrecorded + notes
    covered = coverage(list(cursors.values()), sorted(cursors))
    reason = None
    if first is not None and world is not None:
        reason = world_divergence_reason(world, first)
        notes.append(WORLD_NOT_LOCATED)
    elif first is not None and first.final_state:
        reason = final_state_reason(first, covered, unrecorded=bool(unrecorded))
        notes.append(FINAL_NOT_LOCATED)
    elif first is not None and first.kind == "compute":
        first, locate_notes = _locate_recorded(first, a, b, varied=varied_threads(started))
        notes += locate_notes
    notes += node_notes(a, b, None if first is None else first.rank)
    reproducible: bool | None = first is None
    inconclusive = None if first is not None else inconclusive_verdict(covered, world, bool(unrecorded))
    if inconclusive is not None:
        reproducible = None
        reason, note = inconclusive
        notes.append(note)
    return Comparison(
        reproducible=reproducible,
        steps_compared=steps_compared(list(cursors.values())),
        first_divergence=first,
        coverage=covered,
        env_differences=env_differences,
        tensor=tensor,
        notes=tuple(describe_setting(d) for d in started) + tuple(notes),
        setting_differences=started,
        environment=tuple(env_difference_dict(d, started) for d in env_differences),
        optimizer_steps=optimizer_steps(list(cursors.values())),
        reason=reason,
        world=world,
    )


def _world_size(run: RunRecord) -> int:
    """The number of processes a record ran on: its ``--nproc`` (times its ``--nnodes``: ``--nproc``
    is per node), else the largest process group its ranks noted joining, else 1 (never the events
    files found: a rank that wrote none is missing, not a smaller world)."""
    settings = run.settings
    if settings is not None and settings.nproc:
        return settings.nproc * (settings.nnodes or 1)
    return max(read_world(run.path).values(), default=1)


def _traced_optimizer(run: RunRecord) -> int:
    value = None if run.settings is None else run.settings.trace_optimizer
    return 0 if value is None else value


def _locate_recorded(
    first: Divergence, a: RunRecord, b: RunRecord, *, varied: str | None = None
) -> tuple[Divergence, list[str]]:
    """Fill op/module/location of a compute divergence from the runs' op traces of its step."""
    k = first.step
    hint = (
        f"record both runs with `torchrepro run --trace-step {k}` (or use `torchrepro check`) to name the op"
    )
    if not a.traces and not b.traces:
        return first, [f"no op traces recorded; {hint}"]
    for run in (a, b):
        if k not in run.traces:
            held = ", ".join(str(s) for s in sorted(run.traces)) or "none"
            return first, [f"{run.path} holds op traces of step(s) {held}, not of step {k}; {hint}"]
    if any(optimizer_index(first.key) != _traced_optimizer(run) for run in (a, b)):
        return first, [f"the op traces follow another optimizer than {first.key}; {hint}"]
    ranks = sorted(set(a.traces[k]) & set(b.traces[k]))
    if first.rank not in ranks:
        return first, [f"the op traces of step {k} do not cover rank {first.rank}; {hint}"]
    pairs = [(r, a.traces[k][r], b.traces[k][r]) for r in ranks]
    located, notes, failed = locate_in_traces(first, pairs, varied=varied)
    if located is not None:
        return located, notes
    if failed:
        compared = [r for r in ranks if r not in failed]
        matched = f"; those of rank(s) {', '.join(map(str, compared))} match" if compared else ""
        notes.append(
            f"the op traces of step {k} could not be compared on rank(s) {', '.join(map(str, failed))}"
            f"{matched}: the source op is unknown; {hint}"
        )
        return first, notes
    notes.append(
        f"the op traces of step {k} match on every rank: the difference entered outside the traced ops"
    )
    return first, notes
