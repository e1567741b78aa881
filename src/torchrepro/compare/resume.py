"""Aligning a restarted run with an uninterrupted one, rank by rank (``check --vary resume``).

A run killed after step K and started again counts its steps from 0 and may load a checkpoint
older than step K, so steps are aligned by state, never by counters.

Invariants:
- The restarted run is aligned at J, the number of steps the first run had taken when it held
  the parameters the restarted run's first optimizer step starts from (``runrecord.read_states``:
  its first state), J in 1..K, the latest when several match; parameters equal to the ones the
  first run started from (and to no later ones) mean the restart restored nothing; parameters the
  first run never had before the kill cannot be aligned (the closest step is named).
- Once aligned, the restarted run's optimizer state before its first step must be the first run's
  after step J, and its step ``s`` must be the first run's step ``J + s``: the batches, recorded
  values and other optimizers' steps that lead to it, then the step itself (gradients, optimizer
  state, parameters); extra batches or values before the restarted run's first step (batches a
  script skips by reading them, the values it records while it loads) are not compared. With
  ``compare_final`` (both ran to their end) the restarted run must take exactly the steps left
  and end in the same state; the first difference found in that order is the divergence.
- A divergence is explained where the states say why: an optimizer state not restored, a batch
  that is not the one the first run read at that step, an update that differs from the same state
  and gradients (a learning rate, e.g. a scheduler not restored), or a global RNG state (torch,
  CUDA, NumPy, Python) that differs from the first run's before the step.

Standard library only (the records are read, no tensor is loaded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torchrepro.compare.alignment import event_divergence
from torchrepro.events import FINAL_KEY, describe_name, is_step, optimizer_key
from torchrepro.results import Divergence

__all__ = ["ResumedRank", "align_resumed", "step_segments"]

_STEP_KEY = optimizer_key(0)
_RNG_NAMES = {
    "torch": "torch's CPU",
    "cuda": "CUDA's",
    "numpy": "NumPy's global",
    "python": "Python's random",
}


@dataclass(frozen=True)
class ResumedRank:
    """One rank of a restarted run against the first run: where it was aligned (``restored_at``:
    the first run's steps done when it held the state the restart started from; None: not
    aligned, ``problem`` says why), how many of its optimizer steps were compared (the differing
    one included), the first divergence and, when the states show it, ``explanation``."""

    rank: int
    restored_at: int | None
    steps_compared: int = 0
    divergence: Divergence | None = None
    problem: str | None = None
    explanation: str | None = None
    compared: dict[str, int] = field(default_factory=dict)
    """Events compared per kind (``coverage``)."""


def step_segments(
    events: Sequence[dict[str, Any]],
) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """The events of each step of the first optimizer (each ending with that step's event), and
    what came after the last step (the state at exit)."""
    segments: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for event in events:
        current.append(event)
        if is_step(event["kind"], event["key"]):
            segments.append(current)
            current = []
    return segments, current


def _leaves(entries: Sequence[dict[str, Any]], prefix: str) -> list[tuple[str, str]]:
    return [(str(e.get("n", "")), str(e["fp"])) for e in entries if str(e.get("n", "")).startswith(prefix)]


def _closest(
    b_params: list[tuple[str, str]],
    posts: list[list[tuple[str, str]]],
    start: list[tuple[str, str]],
    kill: int,
) -> str:
    """Why the restart cannot be aligned: the first run's state it comes closest to."""
    last = min(kill, len(posts))  # the latest step first: it wins a tie
    candidates = [(f"after step {n}", posts[n - 1]) for n in range(last, 0, -1)]
    candidates.append(("at its start", start))

    def equal(other: list[tuple[str, str]]) -> int:
        return sum(x[1] == y[1] for x, y in zip(b_params, other, strict=False))

    best_name, best = max(candidates, key=lambda c: equal(c[1]))
    same = equal(best)
    pairs = zip(b_params, best, strict=False)
    differing = next((name for (name, fp), (_, other) in pairs if fp != other), None)
    if len(b_params) != len(best):
        return (
            f"its optimizer holds {len(b_params)} parameter tensors, the first run's {len(best)}: it is "
            "not the same model"
        )
    what = "" if differing is None else f"; the first that differs: {describe_name(differing, 'compute')}"
    return (
        f"the parameters its first optimizer step starts from are none the first run had after steps "
        f"1..{kill} or at its start (it restored a state the first run never had: a partial restore, or "
        f"a checkpoint from elsewhere); closest: the first run {best_name}, {same} of {len(best)} "
        f"parameter tensors equal{what}"
    )


def _rng_explanation(a_state: dict[str, Any] | None, b_state: dict[str, Any] | None, step: int) -> str | None:
    if a_state is None or b_state is None:
        return None
    a_rng, b_rng = a_state.get("rng", {}), b_state.get("rng", {})
    differ = [_RNG_NAMES.get(k, k) for k in a_rng if k in b_rng and a_rng[k] != b_rng[k]]
    if not differ:
        return None
    states = " and ".join(differ)
    return (
        f"{states} RNG state before step {step} is not the first run's: the script does not restore it "
        "from its checkpoint, or draws from it after restoring (restore it last, after building the "
        "model, the optimizer and the DataLoader iterator)"
    )


def align_resumed(
    a_events: Sequence[dict[str, Any]],
    a_states: Sequence[dict[str, Any]],
    b_events: Sequence[dict[str, Any]],
    b_states: Sequence[dict[str, Any]],
    *,
    rank: int,
    kill_after: int,
    compare_final: bool,
) -> ResumedRank:
    """Align the restarted run's rank ``rank`` (``b_*``) with the first run's (``a_*``; its states
    from ``runrecord.read_states``) killed after ``kill_after`` steps; see the module invariants.
    ``compare_final``: both ran to their end (no ``--steps``)."""
    seg_a, tail_a = step_segments(a_events)
    seg_b, tail_b = step_segments(b_events)
    first_b = next((s for s in b_states if "t" in s), None)
    first_a = next((s for s in a_states if "t" in s), None)
    if first_b is None or not seg_b:
        return ResumedRank(rank, None, problem="the restarted run took no optimizer step")
    if first_a is None:
        return ResumedRank(rank, None, problem="the first run noted no state before its first optimizer step")
    b_params = _leaves(first_b["t"], "param:")
    posts = [_leaves(seg[-1].get("t", []), "param:") for seg in seg_a]
    start = _leaves(first_a["t"], "param:")
    fps = [fp for _, fp in b_params]
    matches = [n for n in range(1, min(kill_after, len(posts)) + 1) if [fp for _, fp in posts[n - 1]] == fps]
    if not matches:
        if fps == [fp for _, fp in start]:
            return ResumedRank(
                rank,
                None,
                problem=(
                    f"the restarted run restored nothing: its first optimizer step starts from the "
                    f"parameters the first run started from, not from any it had after steps 1..{kill_after} "
                    "(it trained from the start again: does the script save a checkpoint, and does it need "
                    "an argument to resume from it, --resume-args?)"
                ),
            )
        return ResumedRank(rank, None, problem=_closest(b_params, posts, start, kill_after))
    j = max(matches)
    compared: dict[str, int] = {"compute": 0}

    def result(steps: int, d: Divergence | None = None, why: str | None = None) -> ResumedRank:
        return ResumedRank(rank, j, steps, d, explanation=why, compared=compared)

    # the optimizer state the restart starts from must be the first run's after step j
    a_entries = seg_a[j - 1][-1].get("t", [])
    a_opt = _leaves(a_entries, "state:")
    b_opt = dict(_leaves(first_b["t"], "state:"))
    for name, fp in a_opt:
        if b_opt.get(name) != fp:
            what = describe_name(name, "compute")
            how = "was not restored (the restarted optimizer has none)" if name not in b_opt else "differs"
            leaf = next(e for e in a_entries if e.get("n") == name)
            d = Divergence(
                step=j,
                rank=rank,
                kind="compute",
                key=_STEP_KEY,
                name=name,
                shape=tuple(leaf["shape"]),
                dtype=str(leaf["dtype"]),
            )
            why: str | None = (
                f"the restarted run starts step {j} with the first run's parameters, but {what} {how}"
            )
            return result(1, d, why)
    a_index = {id(e): i for i, e in enumerate(a_events)}
    b_index = {id(e): i for i, e in enumerate(b_events)}
    steps = 0
    for s, n in enumerate(range(j, len(seg_a))):
        if s >= len(seg_b):
            if not compare_final:
                break  # --steps: the first run stopped; the restarted one counts its steps from 0
            d = event_divergence(seg_a[n][-1], None, rank, a_index[id(seg_a[n][-1])])
            why = (
                f"the restarted run ended after {s} optimizer step(s) of its own, at step {n}; the first "
                f"run went on to step {len(seg_a)}"
            )
            return result(steps + 1, d, why)
        steps += 1
        sa, sb = seg_a[n], seg_b[s]
        found = _compare_step(sa, sb, rank, a_index, b_index, leading=s == 0, compared=compared)
        if found is not None:
            why = None
            if found.kind == "data":
                why = (
                    f"the batch of step {n} is not the one the first run read there: the loader did not "
                    "resume at its position (or its order or augmentation draws differ)"
                )
            elif found.key == _STEP_KEY and (found.name or "").startswith(("state:", "param:")):
                why = (  # the gradients come first in the event: they were equal
                    f"step {n} started from the same state with the same gradients, but its update "
                    "differs: the learning rate or another optimizer setting is not the first run's (a "
                    "learning-rate scheduler not restored?)"
                )
            rng = _rng_explanation(
                a_states[n] if n < len(a_states) else None, b_states[s] if s < len(b_states) else None, n
            )
            if rng is not None:
                why = rng if why is None else f"{why}; {rng}"
            return result(steps, found, why)
    if not compare_final:
        return result(steps)
    left = len(seg_a) - j
    if len(seg_b) > left:
        extra = seg_b[left][-1]
        d = event_divergence(None, extra, rank, b_index[id(extra)])
        why = f"the restarted run took {len(seg_b)} optimizer steps of its own; only {left} were left"
        return result(steps + 1, d, why)
    final_a = [e for e in tail_a if e["kind"] == "compute" and e["key"] == FINAL_KEY]
    final_b = [e for e in tail_b if e["kind"] == "compute" and e["key"] == FINAL_KEY]
    for ea, eb in zip(final_a, final_b, strict=False):
        compared[FINAL_KEY] = compared.get(FINAL_KEY, 0) + 1
        if ea["fp"] != eb["fp"]:
            return result(steps, event_divergence(ea, eb, rank, a_index[id(ea)]))
    if len(final_a) != len(final_b):
        extra_a = final_a[len(final_b)] if len(final_a) > len(final_b) else None
        extra_b = final_b[len(final_a)] if extra_a is None else None
        index = a_index[id(extra_a)] if extra_a is not None else b_index[id(extra_b)]
        return result(steps, event_divergence(extra_a, extra_b, rank, index))
    return result(steps)


def _compare_step(
    sa: list[dict[str, Any]],
    sb: list[dict[str, Any]],
    rank: int,
    a_index: dict[int, int],
    b_index: dict[int, int],
    *,
    leading: bool,
    compared: dict[str, int],
) -> Divergence | None:
    """The first difference between one step of each run: its batches, recorded values, other
    optimizers' steps, then the step of the first optimizer. ``leading``: the restarted run's first
    step, where extra leading events (skipped batches, values recorded while loading) are allowed."""
    for kind in ("data", "record", "compute"):
        la = [e for e in sa if e["kind"] == kind and e is not sa[-1]]
        lb = [e for e in sb if e["kind"] == kind and e is not sb[-1]]
        if leading and len(lb) > len(la):
            lb = lb[len(lb) - len(la) :]
        for ea, eb in zip(la, lb, strict=False):
            compared[kind] = compared.get(kind, 0) + 1
            same = ea["fp"] == eb["fp"] and (kind == "data" or ea["key"] == eb["key"])
            if not same:
                eb = {**eb, "key": ea["key"]} if kind == "data" else eb  # loaders compared by content
                return event_divergence(ea, eb, rank, a_index[id(ea)])
        if len(la) != len(lb):
            if len(la) > len(lb):
                extra = la[len(lb)]
                return event_divergence(extra, None, rank, a_index[id(extra)])
            extra = lb[len(la)]
            return event_divergence(None, extra, rank, b_index[id(extra)])
    ea, eb = sa[-1], sb[-1]
    compared["compute"] = compared.get("compute", 0) + 1
    if ea["fp"] != eb["fp"]:
        return event_divergence(ea, {**eb, "step": ea["step"]}, rank, a_index[id(ea)])
    return None
