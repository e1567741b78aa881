"""compare: RankCursor/first_divergence on hand-made events, tensor differences, compare_runs on records."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from torchrepro.compare import (
    RankCursor,
    compare_runs,
    coverage,
    first_divergence,
    optimizer_steps,
    steps_compared,
    tensor_difference,
    world_cursor,
)
from torchrepro.env import Environment
from torchrepro.events import BACKWARD_KEY, FINAL_KEY
from torchrepro.results import Comparison, Coverage, Divergence, TensorDifference, WorldScope
from torchrepro.runrecord import (
    RunSettings,
    events_path,
    trace_path,
    trace_prefix,
    write_env,
    write_run_files,
    write_uncovered,
)
from torchrepro.tracing.locate import _pick_source, locate_in_traces
from torchrepro.verdict import (
    FINAL_NOT_LOCATED,
    UNRECORDED_REASON,
    WORLD_NOT_LOCATED,
    coverage_inconclusive_note,
    coverage_inconclusive_reason,
    describe_setting,
    world_divergence_reason,
)

Event = dict[str, Any]


def ev(i: int, kind: str, key: str, step: int, fp: str = "f", t: list[dict[str, Any]] | None = None) -> Event:
    return {"i": i, "kind": kind, "key": key, "step": step, "fp": fp, "t": [] if t is None else t}


def training(steps: int, *, fps: dict[int, str] | None = None) -> list[Event]:
    """init, then (data, compute) per step; ``fps`` replaces the compute fingerprint of some steps."""
    fps = fps or {}
    events = [ev(0, "init", "optimizer0", 0, "init")]
    for step in range(steps):
        events.append(ev(len(events), "data", "loader0", step, f"d{step}"))
        events.append(ev(len(events), "compute", "optimizer0", step, fps.get(step, f"c{step}")))
    return events


# --- first_divergence / RankCursor ----------------------------------------------------------------


def test_identical_lists_do_not_diverge() -> None:
    assert first_divergence(training(4), training(4)) is None
    assert first_divergence([], []) is None


def test_a_differing_fingerprint_is_located() -> None:
    d = first_divergence(training(5), training(5, fps={2: "other"}), rank=3)
    assert d is not None
    assert (d.kind, d.step, d.rank, d.key, d.index) == ("compute", 2, 3, "optimizer0", 6)
    assert (d.op, d.module, d.location) == (None, None, None)


@pytest.mark.parametrize("field", ["kind", "key", "step", "fp"])
def test_every_compared_field_counts(field: str) -> None:
    a = training(3)
    b = training(3)
    b[4] = {**b[4], field: 99 if field == "step" else "changed"}
    d = first_divergence(a, b)
    assert d is not None and d.index == 4


def test_the_i_and_t_fields_are_not_compared() -> None:
    b = [{**e, "i": e["i"] + 100, "t": [{"fp": "x"}]} for e in training(3)]
    assert first_divergence(training(3), b) is None


@pytest.mark.parametrize("longer", ["a", "b"])
def test_a_missing_event_at_the_end_diverges_once_the_other_side_is_done(longer: str) -> None:
    full, short = training(3), training(2)
    a, b = (full, short) if longer == "a" else (short, full)
    cursor = RankCursor(0, a, b)
    assert cursor.advance() is None  # the shorter side may still be running
    # the longer side finishing says nothing: it is the shorter one that must be done
    assert cursor.advance(a_done=longer == "a", b_done=longer == "b") is None
    d = cursor.advance(a_done=longer == "b", b_done=longer == "a")
    assert d is not None
    assert (d.kind, d.step, d.index) == ("data", 2, len(short))
    assert first_divergence(a, b) == d


def test_cursor_compares_events_as_they_arrive() -> None:
    a: list[Event] = []
    b: list[Event] = []
    cursor = RankCursor(1, a, b)
    source = training(3, fps={2: "x"})
    for e in training(3)[:5]:
        a.append(e)
    assert cursor.advance() is None and cursor.position == 0
    b.extend(source[:3])
    assert cursor.advance() is None and cursor.position == 3
    b.extend(source[3:])  # b is now complete and has diverged at index 6
    assert cursor.advance() is None and cursor.position == 5  # a has only 5 events yet
    a.extend(training(3)[5:])
    d = cursor.advance()
    assert d is not None and (d.step, d.index, d.rank) == (2, 6, 1)
    assert cursor.advance(a_done=True, b_done=True) is d  # sticky: the first divergence stays


@pytest.mark.parametrize(
    ("a_event", "b_event", "expected"),
    [
        # different kind/key at one position: the earlier step of the two is reported
        (ev(0, "compute", "optimizer0", 3), ev(0, "data", "loader0", 2), ("data", 2, "loader0")),
        (ev(0, "data", "loader0", 2), ev(0, "compute", "optimizer0", 3), ("data", 2, "loader0")),
        (ev(0, "record", "loss", 1), ev(0, "record", "acc", 0), ("record", 0, "acc")),
        # same step: the first run's event
        (ev(0, "compute", "optimizer0", 2), ev(0, "data", "loader0", 2), ("compute", 2, "optimizer0")),
        # same kind and key: the first run's event, whatever the step
        (
            ev(0, "compute", "optimizer0", 3, "x"),
            ev(0, "compute", "optimizer0", 3, "y"),
            ("compute", 3, "optimizer0"),
        ),
    ],
)
def test_which_event_a_divergence_reports(
    a_event: Event, b_event: Event, expected: tuple[str, int, str]
) -> None:
    d = first_divergence([a_event], [b_event])
    assert d is not None
    assert (d.kind, d.step, d.key) == expected


# --- steps_compared / earliest --------------------------------------------------------------------


def test_steps_compared_counts_compute_steps_reached() -> None:
    identical = RankCursor(0, training(5), training(5))
    identical.advance(a_done=True, b_done=True)
    assert steps_compared([identical]) == 5
    diverged = RankCursor(1, training(5), training(5, fps={2: "x"}))
    diverged.advance(a_done=True, b_done=True)
    assert steps_compared([diverged]) == 3  # steps 0, 1 and the diverging step 2
    assert steps_compared([identical, diverged]) == 5  # the furthest rank
    assert steps_compared([RankCursor(0, training(5), training(5))]) == 0  # nothing advanced yet
    assert steps_compared([]) == 0


def test_divergence_to_dict_is_the_verdict_shape() -> None:
    d = Divergence(step=2, rank=1, kind="compute", op="aten.mm", key="optimizer0", index=7)
    assert d.to_dict() == {
        "step": 2,
        "rank": 1,
        "kind": "compute",
        "op": "aten.mm",
        "module": None,
        "location": None,
        "key": "optimizer0",
        "name": None,
        "shape": None,
        "dtype": None,
    }


# --- tensor_difference ----------------------------------------------------------------------------


def leaf(fp: str, v: list[float] | None = None, shape: list[int] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"fp": fp, "dtype": "float32", "shape": shape or [len(v or [1])]}
    if v is not None:
        entry["v"] = v
    return entry


def with_leaves(*leaves: dict[str, Any]) -> Event:
    return ev(0, "compute", "optimizer0", 0, "f", list(leaves))


def test_tensor_difference_from_stored_values() -> None:
    a = with_leaves(leaf("same", [1.0]), leaf("a", [1.0, 2.0, 3.0]))
    b = with_leaves(leaf("same", [1.0]), leaf("b", [1.0, 2.5, 2.0]))
    assert tensor_difference(a, b) == TensorDifference(leaf=1, shape=[3], dtype="float32", max_abs_diff=1.0)


def test_tensor_difference_without_stored_values() -> None:
    a = with_leaves(leaf("a", shape=[1000]))
    b = with_leaves(leaf("b", shape=[1000]))
    assert tensor_difference(a, b) == TensorDifference(
        leaf=0, shape=[1000], dtype="float32", max_abs_diff=None
    )
    one_side = with_leaves(leaf("b", [1.0, 2.0]))
    assert tensor_difference(with_leaves(leaf("a", [1.0])), one_side) is not None
    assert tensor_difference(with_leaves(leaf("a", [1.0])), one_side).max_abs_diff is None  # type: ignore[union-attr]


def test_no_tensor_difference_when_the_leaves_agree() -> None:
    same = with_leaves(leaf("x", [1.0]), leaf("y", [2.0]))
    assert tensor_difference(same, same) is None
    assert tensor_difference(ev(0, "data", "loader0", 0), ev(0, "data", "loader0", 0)) is None


def test_nan_in_both_runs_at_one_place_is_no_difference() -> None:
    a = with_leaves(leaf("a", [math.nan, 1.0]))
    b = with_leaves(leaf("b", [math.nan, 1.5]))
    assert tensor_difference(a, b).max_abs_diff == 0.5  # type: ignore[union-attr]


def test_nan_on_one_side_is_never_reported_as_no_difference() -> None:
    a = with_leaves(leaf("a", [0.0, math.nan]))
    b = with_leaves(leaf("b", [0.0, 1.0]))
    d = tensor_difference(a, b)
    assert d is not None and d.max_abs_diff != 0.0


def test_equal_infinities_are_no_difference() -> None:
    a = with_leaves(leaf("a", [math.inf, 1.0]))
    b = with_leaves(leaf("b", [math.inf, 3.0]))
    assert tensor_difference(a, b).max_abs_diff == 2.0  # type: ignore[union-attr]


# --- compare_runs on hand-made records ------------------------------------------------------------

ENV = Environment(torch_version="2.4.0", python_version="3.11.4", num_threads=4, hostname="alpha")


def make_record(
    path: Path,
    events: dict[int, list[Event]],
    *,
    env: dict[str, Any] | None = None,
    settings: RunSettings | None = None,
) -> Path:
    path.mkdir(parents=True)
    for rank, evs in events.items():
        events_path(path, rank).write_text("".join(json.dumps(e) + "\n" for e in evs), encoding="utf-8")
    if env is not None:
        write_env(path, env)
    if settings is not None:
        write_run_files(path, ["python", "t.py"], settings)
    return path


def test_identical_records_are_reproducible(tmp_path: Path) -> None:
    a = make_record(tmp_path / "a", {0: training(3), 1: training(3)}, env=ENV.to_dict())
    b = make_record(tmp_path / "b", {0: training(3), 1: training(3)}, env=ENV.to_dict())
    result = compare_runs(a, b)
    covered = Coverage(
        per_rank={0: {"init": 1, "data": 3, "compute": 3}, 1: {"init": 1, "data": 3, "compute": 3}},
        ranks_expected=(0, 1),
    )
    assert result == Comparison(
        reproducible=True,
        steps_compared=3,
        first_divergence=None,
        coverage=covered,
        optimizer_steps={"optimizer0": 3},  # the most one rank compared, not summed over ranks
    )
    data = result.to_dict()
    assert data["coverage"] == {
        "per_kind": {"compute": 6, "data": 6, "init": 2},
        "per_rank": {"0": {"compute": 3, "data": 3, "init": 1}, "1": {"compute": 3, "data": 3, "init": 1}},
        "uncovered_ranks": [],
    }
    assert data["inconclusive"] is False
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert (data["reproducible"], data["runs"], data["first_divergence"], data["notes"]) == (
        True,
        2,
        None,
        [],
    )


def test_a_compute_divergence_without_traces_says_how_to_name_the_op(tmp_path: Path) -> None:
    a = make_record(tmp_path / "a", {0: training(4)})
    b = make_record(tmp_path / "b", {0: training(4, fps={1: "x"})})
    result = compare_runs(a, b)
    assert not result.reproducible
    assert result.first_divergence is not None
    assert (result.first_divergence.kind, result.first_divergence.step) == ("compute", 1)
    assert result.steps_compared == 2
    (note,) = result.notes
    assert "no op traces recorded" in note and "--trace-step 1" in note
    assert result.env_differences == []


def test_a_data_divergence_gets_no_locating_note(tmp_path: Path) -> None:
    b_events = training(3)
    b_events[3] = {**b_events[3], "fp": "other batch"}
    result = compare_runs(
        make_record(tmp_path / "a", {0: training(3)}), make_record(tmp_path / "b", {0: b_events})
    )
    assert result.first_divergence is not None
    assert (result.first_divergence.kind, result.first_divergence.step) == ("data", 1)
    assert result.notes == ()


def test_the_earliest_rank_divergence_is_reported(tmp_path: Path) -> None:
    a = make_record(tmp_path / "a", {0: training(4), 1: training(4)})
    b = make_record(tmp_path / "b", {0: training(4, fps={3: "x"}), 1: training(4, fps={1: "x"})})
    d = compare_runs(a, b).first_divergence
    assert d is not None and (d.rank, d.step) == (1, 1)


def test_a_rank_missing_from_one_run_diverges_at_its_first_event(tmp_path: Path) -> None:
    a = make_record(tmp_path / "a", {0: training(2), 1: training(2)})
    b = make_record(tmp_path / "b", {0: training(2)})
    result = compare_runs(a, b)
    d = result.first_divergence
    assert d is not None and (d.rank, d.index, d.kind) == (1, 0, "init")
    assert not result.reproducible


def test_the_first_differing_tensor_is_reported(tmp_path: Path) -> None:
    a_events, b_events = training(2), training(2)
    a_events[2] = {**a_events[2], "t": [leaf("p", [1.0, 2.0])]}
    b_events[2] = {**b_events[2], "fp": "x", "t": [leaf("q", [1.0, 2.25])]}
    result = compare_runs(
        make_record(tmp_path / "a", {0: a_events}), make_record(tmp_path / "b", {0: b_events})
    )
    assert result.tensor == TensorDifference(leaf=0, shape=[2], dtype="float32", max_abs_diff=0.25)
    assert result.to_dict()["tensor"] == {
        "leaf": 0,
        "shape": [2],
        "dtype": "float32",
        "max_abs_diff": 0.25,
        "nonfinite": False,
        "name": None,
        "sampled": False,
    }


def test_a_large_tensor_is_compared_by_its_sample_as_a_lower_bound() -> None:
    big = {"fp": "a", "dtype": "float32", "shape": [1000], "s": [0.0] * 8}
    other = {**big, "fp": "b", "s": [0.0] * 7 + [1e-3]}
    d = tensor_difference({"t": [big]}, {"t": [other]})
    assert d is not None and d.sampled and d.max_abs_diff == 1e-3
    assert d.describe_difference().startswith("at least 0.001")
    same_sample = tensor_difference({"t": [big]}, {"t": [{**big, "fp": "b"}]})
    assert same_sample is not None and same_sample.max_abs_diff == 0.0
    assert "not seen" in same_sample.describe_difference()
    # every value (``v``) wins over a sample; values of another shape are not compared
    assert tensor_difference({"t": [{**big, "v": [1.0]}]}, {"t": [{**other, "v": [3.0]}]}).max_abs_diff == 2.0  # type: ignore[union-attr]
    reshaped = {**other, "shape": [10, 100]}
    assert tensor_difference({"t": [big]}, {"t": [reshaped]}).max_abs_diff is None  # type: ignore[union-attr]


def test_environment_differences_are_listed(tmp_path: Path) -> None:
    other = dataclasses.replace(ENV, num_threads=8, hostname="beta")
    a = make_record(tmp_path / "a", {0: training(2)}, env=ENV.to_dict())
    b = make_record(tmp_path / "b", {0: training(2)}, env=other.to_dict())
    result = compare_runs(a, b)
    assert result.reproducible  # an environment difference alone is not a divergence
    found = {d.key: (d.a, d.b, d.breaks) for d in result.env_differences}
    assert found == {"num_threads": (4, 8, True), "hostname": ("alpha", "beta", False)}
    listed = result.to_dict()["env_differences"]
    assert {d["key"] for d in listed} == {"num_threads", "hostname"}
    assert all(set(d) == {"key", "a", "b", "breaks", "reason", "volatile", "setting"} for d in listed)
    assert not any(d["volatile"] or d["setting"] for d in listed)  # neither is when/where, nor a setting


@pytest.mark.parametrize(
    "env_b",
    [None, {"error": "collect_env failed: OSError: x"}, {"not": "an environment"}, {"torch_version": 3}],
)
def test_missing_or_unreadable_environment_lists_nothing_and_keeps_the_verdict(
    tmp_path: Path, env_b: dict[str, Any] | None
) -> None:
    a = make_record(tmp_path / "a", {0: training(2)}, env=ENV.to_dict())
    b = make_record(tmp_path / "b", {0: training(2, fps={1: "x"})}, env=env_b)
    result = compare_runs(a, b)
    assert result.env_differences == []
    assert result.first_divergence is not None and result.first_divergence.step == 1


def test_traces_of_another_step_are_named_in_the_note(tmp_path: Path) -> None:
    a = make_record(tmp_path / "a", {0: training(4)})
    b = make_record(tmp_path / "b", {0: training(4, fps={2: "x"})})
    for run in (a, b):
        trace_path(trace_prefix(run, 0), 0).write_text("{}")
    (note,) = compare_runs(a, b).notes
    assert "holds op traces of step(s) 0, not of step 2" in note and "--trace-step 2" in note


def test_traces_of_another_optimizer_are_named_in_the_note(tmp_path: Path) -> None:
    settings = RunSettings(trace_step=1, trace_optimizer=1)
    a = make_record(tmp_path / "a", {0: training(3)}, settings=settings)
    b = make_record(tmp_path / "b", {0: training(3, fps={1: "x"})}, settings=settings)
    for run in (a, b):
        trace_path(trace_prefix(run, 1), 0).write_text("{}")
    (note,) = compare_runs(a, b).notes
    assert "another optimizer than optimizer0" in note


def _traced(path: Path, factor: float) -> None:
    with torch.no_grad():
        from torchrepro.tracing import trace

        with trace(path):
            x = torch.arange(4.0)
            (x * 2).sum() * factor


def test_recorded_traces_of_the_diverging_step_name_the_op(tmp_path: Path) -> None:
    a = make_record(tmp_path / "a", {0: training(3)})
    b = make_record(tmp_path / "b", {0: training(3, fps={1: "x"})})
    _traced(trace_path(trace_prefix(a, 1), 0), 1.0)
    _traced(trace_path(trace_prefix(b, 1), 0), 1.5)
    result = compare_runs(a, b)
    d = result.first_divergence
    assert d is not None and (d.kind, d.step, d.rank) == ("compute", 1, 0)
    assert d.op == "aten.mul.Tensor"
    assert d.location is not None and "test_compare.py" in d.location


def test_matching_traces_say_the_difference_entered_outside_them(tmp_path: Path) -> None:
    a = make_record(tmp_path / "a", {0: training(3)})
    b = make_record(tmp_path / "b", {0: training(3, fps={1: "x"})})
    _traced(trace_path(trace_prefix(a, 1), 0), 1.0)
    _traced(trace_path(trace_prefix(b, 1), 0), 1.0)
    result = compare_runs(a, b)
    assert result.first_divergence is not None and result.first_divergence.op is None
    assert any("match on every rank" in note for note in result.notes)


def test_unreadable_traces_are_not_reported_as_matching(tmp_path: Path) -> None:
    a = make_record(tmp_path / "a", {0: training(3)})
    b = make_record(tmp_path / "b", {0: training(3, fps={1: "x"})})
    for run in (a, b):
        trace_path(trace_prefix(run, 1), 0).write_text("not a trace")
    notes = compare_runs(a, b).notes
    assert any("comparing the op traces of rank 0 failed" in n for n in notes)
    assert not any("match on every rank" in n for n in notes)


def test_locate_in_traces_reports_unreadable_traces(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_text("not a trace")
    first = Divergence(step=0, rank=0, kind="compute")
    located, notes, failed = locate_in_traces(first, [(0, bad, bad)])
    assert failed == [0]
    assert located is None
    (note,) = notes
    assert "comparing the op traces of rank 0 failed: TraceError" in note


def test_pick_source_prefers_a_non_collective_op_then_the_rank() -> None:
    mm, reduce = SimpleNamespace(op="aten.mm.default"), SimpleNamespace(op="c10d.allreduce_.default")
    assert _pick_source([(0, reduce), (1, mm)], prefer_rank=0) == (1, mm)
    assert _pick_source([(0, mm), (1, mm)], prefer_rank=1) == (1, mm)
    assert _pick_source([(0, mm), (2, mm)], prefer_rank=1) == (0, mm)
    assert _pick_source([(0, reduce), (1, reduce)], prefer_rank=1) == (1, reduce)


def test_compare_runs_refuses_a_directory_that_is_no_record(tmp_path: Path) -> None:
    from torchrepro.errors import EnvFileError

    a = make_record(tmp_path / "a", {0: training(1)})
    (tmp_path / "empty").mkdir()
    with pytest.raises(EnvFileError, match="no events"):
        compare_runs(a, tmp_path / "empty")


# --- coverage: "nothing compared" is never a pass ----------------------------------------------------


@pytest.mark.parametrize(
    ("a_events", "b_events", "verdict", "uncovered"),
    [
        ({0: training(2)}, {0: training(2)}, True, []),  # steps compared: a pass
        ({0: training(0)}, {0: training(0)}, None, [0]),  # only init: inconclusive
        ({0: []}, {0: []}, None, [0]),  # nothing at all
        ({0: training(2), 1: training(0)}, {0: training(2), 1: training(0)}, None, [1]),  # rank 1 idle
        ({0: [ev(0, "record", "loss", 0)]}, {0: [ev(0, "record", "loss", 0)]}, True, []),  # a record()
        ({0: training(0)}, {0: [ev(0, "init", "optimizer0", 0, "other")]}, False, [0]),  # init differs
    ],
)
def test_a_verdict_never_claims_more_than_was_compared(
    tmp_path: Path,
    a_events: dict[int, list[Event]],
    b_events: dict[int, list[Event]],
    verdict: bool | None,
    uncovered: list[int],
) -> None:
    result = compare_runs(make_record(tmp_path / "a", a_events), make_record(tmp_path / "b", b_events))
    assert result.reproducible is verdict
    data = result.to_dict()
    assert data["coverage"]["uncovered_ranks"] == uncovered
    assert data["inconclusive"] is (verdict is None)
    assert any(n.startswith("inconclusive:") for n in result.notes) is (verdict is None)


def test_coverage_counts_compared_events_per_rank_and_kind() -> None:
    a, b = training(3), training(3, fps={2: "x"})  # diverges at the third compute event
    cursor = RankCursor(0, a, b)
    assert cursor.advance(a_done=True, b_done=True) is not None
    covered = coverage([cursor], [0, 1])
    assert covered.per_rank == {0: {"init": 1, "data": 3, "compute": 3}}  # the diverging one counts
    assert covered.uncovered_ranks == (1,)  # rank 1 had no record: not covered
    assert not covered.conclusive
    assert "nothing beyond init compared on rank(s) 1" in covered.describe()
    assert coverage([cursor], [0]).conclusive


def test_an_inconclusive_note_says_which_ranks_were_not_compared() -> None:
    """Training compared on rank 0 only: the note must not claim nothing was compared at all."""
    partial = Coverage(per_rank={0: {"init": 1, "compute": 3}, 1: {"init": 1}}, ranks_expected=(0, 1, 2))
    assert coverage_inconclusive_note(partial) == (
        "inconclusive: nothing that changes during training was compared on rank(s) 1, 2 (training "
        "was compared on rank(s) 0); a rank that was not compared cannot pass"
    )
    nothing = Coverage(per_rank={0: {"init": 1, "final": 1}}, ranks_expected=(0,))
    assert coverage_inconclusive_note(nothing).startswith(
        "inconclusive: nothing that changes during training was compared:"
    )
    assert "optimizer step" in coverage_inconclusive_note(nothing)


# --- verdicts that name the real reason ------------------------------------------------------------


def final(fp: str, step: int = 0) -> Event:
    """The state at exit: a ``compute`` event keyed ``final`` whose tensors are named ``final:<var>...``."""
    return ev(99, "compute", "final", step, fp, [{"n": "final:netD.main.0.weight", **leaf(fp, [1.0])}])


def test_a_divergence_only_in_the_final_state_is_said_so_and_not_located(tmp_path: Path) -> None:
    """Nothing recorded trained it: not "compute at step 0", and no locating hint (no step to trace)."""
    a = make_record(tmp_path / "a", {0: [final("a")]})
    b = make_record(tmp_path / "b", {0: [final("b")]})
    result = compare_runs(a, b)
    d = result.first_divergence
    assert result.reproducible is False and d is not None and d.final_state
    assert d.final_module() == "netD"
    assert result.reason is not None and result.reason.startswith(
        "the runs differ only in the final state of netD: the training that changed it was not "
        "recorded (the process holding it took no optimizer step and ran no backward()"
    )
    assert result.notes == (FINAL_NOT_LOCATED,)  # no "record both runs with --trace-step 0"
    assert result.to_dict()["reason"] == result.reason
    # after recorded steps that matched, the reason says so
    a2 = make_record(tmp_path / "a2", {0: [*training(2), final("a", 2)]})
    b2 = make_record(tmp_path / "b2", {0: [*training(2), final("b", 2)]})
    reason = compare_runs(a2, b2).reason
    assert reason is not None and "every recorded training step matched" in reason
    # control: a divergence in a step is no final-state divergence, and gets the locating hint
    c = make_record(tmp_path / "c", {0: training(2, fps={1: "x"})})
    result = compare_runs(a2, c)
    assert result.first_divergence is not None and not result.first_divergence.final_state
    assert result.reason is None and any("--trace-step 1" in n for n in result.notes)


def test_training_a_record_notes_as_unrecorded_is_named_in_compare(tmp_path: Path) -> None:
    a = make_record(tmp_path / "a", {0: [final("a")]})
    b = make_record(tmp_path / "b", {0: [final("b")]})
    for run in (a, b):
        write_uncovered(
            run, 7, ["python", "t.py"], "it was forked from a process of the run and trained there"
        )
    result = compare_runs(a, b)
    assert (
        result.reason is not None
        and "(it trained in python processes torchrepro does not record" in result.reason
    )
    assert "in both runs: python child `python t.py` was not recorded: it was forked" in result.notes[0]
    # equal final states with the training unrecorded: inconclusive, saying where the training went
    same = make_record(tmp_path / "same", {0: [final("a")]})
    write_uncovered(same, 8, ["python", "t.py"], "it was forked from a process of the run and trained there")
    result = compare_runs(a, same)
    assert result.reproducible is None
    assert result.reason == (
        "nothing was compared: the training ran in python processes torchrepro does not record "
        "(see the notes)"
    )
    # training compared, but a child trained unrecorded too: still no pass
    a3 = make_record(tmp_path / "a3", {0: training(2)})
    b3 = make_record(tmp_path / "b3", {0: training(2)})
    write_uncovered(b3, 9, ["python", "child.py"], "it trained in no process group")
    result = compare_runs(a3, b3)
    assert (result.reproducible, result.reason) == (None, UNRECORDED_REASON)
    assert (
        result.notes[0]
        == "in run B: python child `python child.py` was not recorded: it trained in no process group"
    )


def test_optimizer_steps_are_counted_per_optimizer() -> None:
    """Two optimizers stepping 3 times each: 3 training steps, 6 optimizer steps."""
    events = [ev(0, "init", "optimizer0", 0), ev(1, "init", "optimizer1", 0)]
    for step in range(3):
        events += [
            ev(len(events), "compute", "optimizer0", step),
            ev(len(events) + 1, "compute", "optimizer1", step),
        ]
    events.append(ev(len(events), "compute", "final", 3))
    cursors = [RankCursor(r, events, list(events)) for r in (0, 1)]
    for cursor in cursors:
        assert cursor.advance(a_done=True, b_done=True) is None
    assert steps_compared(cursors) == 3
    assert optimizer_steps(cursors) == {"optimizer0": 3, "optimizer1": 3}  # per rank, not summed
    # backward() steps and the final state are no optimizer steps
    manual = [ev(0, "init", "backward", 0), ev(1, "compute", "backward", 0), ev(2, "compute", "backward", 0)]
    cursor = RankCursor(0, manual, manual)
    cursor.advance(a_done=True, b_done=True)
    assert (steps_compared([cursor]), optimizer_steps([cursor])) == (1, {})


def test_an_inconclusive_reason_is_specific() -> None:
    partial = Coverage(per_rank={0: {"init": 1, "compute": 3}, 1: {"init": 1}}, ranks_expected=(0, 1))
    assert coverage_inconclusive_reason(partial) == (
        "rank(s) 1 were not compared: nothing that changes during training was recorded there "
        "(training was compared on rank(s) 0)"
    )
    nothing = Coverage(per_rank={0: {"final": 1}}, ranks_expected=(0,))
    assert coverage_inconclusive_reason(nothing).startswith(
        "nothing that changes during training was compared:"
    )
    assert coverage_inconclusive_reason(nothing, unrecorded=True).startswith(
        "nothing was compared: the training ran in python processes torchrepro does not record"
    )
    assert "not record" in coverage_inconclusive_note(nothing, unrecorded=True)
    # a definite divergence does not carry the "nothing compared" remark
    assert "nothing beyond init" in nothing.describe()
    assert "nothing beyond init" not in nothing.describe(uncovered=False)


THREADS_ENV = dataclasses.replace(
    ENV,
    collected_at="2026-01-01T00:00:00+00:00",
    env_vars={
        "OMP_NUM_THREADS": None,
        "TORCHREPRO_RECORD_DIR": "/records/a",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    },
)


def test_compare_names_a_threads_difference_a_setting_and_marks_volatile_fields(tmp_path: Path) -> None:
    env_b = dataclasses.replace(
        THREADS_ENV,
        collected_at="2026-01-01T00:00:09+00:00",
        env_vars={
            "OMP_NUM_THREADS": "2",
            "TORCHREPRO_RECORD_DIR": "/records/b",
            "CUBLAS_WORKSPACE_CONFIG": ":16:8",
        },
    )
    a = make_record(tmp_path / "a", {0: training(2)}, env=THREADS_ENV.to_dict(), settings=RunSettings(seed=0))
    b = make_record(
        tmp_path / "b",
        {0: training(2)},
        env=env_b.to_dict(),
        settings=RunSettings(seed=0, threads=2, OMP_NUM_THREADS="2"),
    )
    result = compare_runs(a, b)
    assert [d.name for d in result.setting_differences] == ["threads"]  # OMP_NUM_THREADS is the same cause
    assert result.notes[0].startswith(
        "started with different threads: not pinned vs 2 (a settings difference, not nondeterminism"
    )
    listed = {d["key"]: d for d in result.to_dict()["env_differences"]}
    assert (listed["collected_at"]["volatile"], listed["collected_at"]["setting"]) == (True, None)
    assert listed["env_vars.TORCHREPRO_RECORD_DIR"]["volatile"] is True
    assert (
        listed["env_vars.OMP_NUM_THREADS"]["volatile"],
        listed["env_vars.OMP_NUM_THREADS"]["setting"],
    ) == (
        False,
        "threads",
    )
    # control: a difference no setting explains is neither
    assert (
        listed["env_vars.CUBLAS_WORKSPACE_CONFIG"]["setting"],
        listed["env_vars.CUBLAS_WORKSPACE_CONFIG"]["volatile"],
    ) == (None, False)


def test_compare_names_a_portable_difference_once_and_the_environment_it_set(tmp_path: Path) -> None:
    """--portable sets MKL_CBWR, the CPU ISA and oneDNN's switch: one setting difference explains all."""
    env_plain = dataclasses.replace(
        THREADS_ENV,
        cpu_capability="AVX512",
        determinism={"mkldnn_enabled": True},
        env_vars={"TORCHREPRO_RECORD_DIR": "/records/a"},
    )
    env_portable = dataclasses.replace(
        env_plain,
        cpu_capability="AVX2",
        determinism={"mkldnn_enabled": False},
        env_vars={
            "TORCHREPRO_RECORD_DIR": "/records/b",
            "TORCHREPRO_PORTABLE": "1",
            "MKL_CBWR": "AVX2,STRICT",
            "ATEN_CPU_CAPABILITY": "avx2",
        },
    )
    a = make_record(tmp_path / "a", {0: training(2)}, env=env_plain.to_dict(), settings=RunSettings(seed=0))
    portable = RunSettings(seed=0, portable=True, MKL_CBWR="AVX2,STRICT", ATEN_CPU_CAPABILITY="avx2")
    b = make_record(tmp_path / "b", {0: training(2)}, env=env_portable.to_dict(), settings=portable)
    result = compare_runs(a, b)
    assert [d.name for d in result.setting_differences] == ["portable"]
    assert result.notes[0].startswith(
        "started with different portable: off vs on (a settings difference, not nondeterminism: portable mode"
    )
    listed = {d["key"]: d["setting"] for d in result.to_dict()["env_differences"] if not d["volatile"]}
    assert listed == {
        "cpu_capability": "portable",
        "determinism.mkldnn_enabled": "portable",
        "env_vars.MKL_CBWR": "portable",
        "env_vars.ATEN_CPU_CAPABILITY": "portable",
        "env_vars.TORCHREPRO_PORTABLE": "portable",
    }
    # control: an older record (no portable field) and a plain one do not differ in portability
    old = make_record(tmp_path / "c", {0: training(2)}, settings=RunSettings(seed=0, portable=None))
    plain = make_record(tmp_path / "d", {0: training(2)}, settings=RunSettings(seed=0, portable=False))
    assert compare_runs(old, plain).setting_differences == ()
    # and a user's own MKL_CBWR, without --portable, is a difference of its own
    kept = make_record(tmp_path / "e", {0: training(2)}, settings=RunSettings(seed=0, MKL_CBWR="AVX2"))
    assert [describe_setting(d) for d in compare_runs(plain, kept).setting_differences] == [
        "started with different MKL_CBWR: unset vs 'AVX2'"
    ]


def test_compare_passes_a_threads_difference_to_the_op_locator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An op whose output depends on the thread count is a settings difference, not nondeterminism."""
    import torchrepro.compare.runs as compare_module

    seen: list[str | None] = []

    def fake_locate(first: Divergence, traces: Any, *, varied: str | None = None) -> Any:
        seen.append(varied)
        return None, [], []

    monkeypatch.setattr(compare_module, "locate_in_traces", fake_locate)
    for name, threads in (("a", 1), ("b", 2)):
        run = make_record(
            tmp_path / name,
            {0: training(2, fps={0: name})},
            settings=RunSettings(seed=0, threads=threads, trace_step=0),
        )
        trace_path(trace_prefix(run, 0), 0).write_text("{}")
    compare_runs(tmp_path / "a", tmp_path / "b")
    assert seen == ["between 1 thread (run A) and 2 threads (run B)"]
    # control: runs started alike pass no setting
    seen.clear()
    run = make_record(
        tmp_path / "c", {0: training(2, fps={0: "c"})}, settings=RunSettings(seed=0, threads=1, trace_step=0)
    )
    trace_path(trace_prefix(run, 0), 0).write_text("{}")
    compare_runs(tmp_path / "a", tmp_path / "c")
    assert seen == [None]


# --- across world sizes ---------------------------------------------------------------------------


def split_training(steps: int, *, world: int, rank: int, fps: dict[int, str] | None = None) -> list[Event]:
    """A rank's events when a global batch of 4 micro-batches is split across ``world`` processes:
    its own batches, backward() steps and loss differ by rank and world, its optimizer steps do not."""
    fps = fps or {}
    events = [ev(0, "init", "optimizer0", 0, "init")]
    for step in range(steps):
        for j in range(4 // world):
            micro = step * 4 + rank * (4 // world) + j
            events.append(ev(len(events), "data", "loader0", step * (4 // world) + j, f"d{micro}"))
            events.append(ev(len(events), "compute", BACKWARD_KEY, micro, f"g{micro}"))
        events.append(ev(len(events), "compute", "optimizer0", step, fps.get(step, f"c{step}")))
        events.append(ev(len(events), "record", "loss", step, f"loss{world}.{rank}.{step}"))
    events.append(ev(len(events), "compute", FINAL_KEY, steps, "end"))
    return events


def world_records(
    tmp_path: Path, *, steps: int = 3, fps: dict[int, dict[int, str]] | None = None, ranks: int = 2
) -> tuple[Path, Path]:
    """A record on 1 process and one on 2 (``fps``: rank of the second -> step -> fingerprint)."""
    fps = fps or {}
    one = make_record(
        tmp_path / "one", {0: split_training(steps, world=1, rank=0)}, settings=RunSettings(nproc=1)
    )
    two = make_record(
        tmp_path / "two",
        {r: split_training(steps, world=2, rank=r, fps=fps.get(r)) for r in range(ranks)},
        settings=RunSettings(nproc=2),
    )
    return one, two


def test_records_on_different_world_sizes_compare_only_what_must_not_depend_on_the_split(
    tmp_path: Path,
) -> None:
    one, two = world_records(tmp_path)
    assert compare_runs(one, one).world is None  # the same world size: every event, rank by rank
    for a, b in ((one, two), (two, one)):
        result = compare_runs(a, b)
        assert result.reproducible is True and result.first_divergence is None
        assert result.world == WorldScope(1, 2) and result.steps_compared == 3
        per_rank = {"init": 1, "compute": 3, "final": 1}  # no batch, backward() step or recorded value
        assert result.coverage == Coverage(per_rank={0: per_rank, 1: per_rank}, ranks_expected=(0, 1))
        data = result.to_dict()
        assert data["world"] == WorldScope(1, 2).to_dict()
        assert any(
            n.startswith("compared across world sizes: rank 0 of the run on 1 process") for n in data["notes"]
        )
    # rank by rank, the same records part at the first batch the split moves (the second one)
    assert (
        compare_runs(
            one, make_record(tmp_path / "one2", {0: split_training(3, world=2, rank=0)})
        ).reproducible
        is False
    )


def test_a_multi_node_record_runs_on_nproc_times_nnodes_processes(tmp_path: Path) -> None:
    # --nproc is per node: 2 nodes x 2 is the world of 4 processes on one node, compared rank by rank
    events = {r: split_training(2, world=4, rank=r) for r in range(4)}
    one_node = make_record(tmp_path / "one", events, settings=RunSettings(nproc=4))
    two_nodes = make_record(tmp_path / "two", events, settings=RunSettings(nproc=2, nnodes=2))
    result = compare_runs(one_node, two_nodes)
    assert result.world is None and result.reproducible is True
    assert sorted(result.coverage.per_rank) == [0, 1, 2, 3]
    halves = make_record(tmp_path / "half", {r: events[r] for r in range(2)}, settings=RunSettings(nproc=2))
    assert compare_runs(halves, two_nodes).world == WorldScope(2, 4)  # control: a world of 2 is another


def test_an_optimizer_step_differing_across_world_sizes_is_named_with_why(tmp_path: Path) -> None:
    one, two = world_records(tmp_path, fps={1: {1: "other"}})
    result = compare_runs(one, two)
    d = result.first_divergence
    assert d is not None and (d.kind, d.step, d.rank, d.key) == ("compute", 1, 1, "optimizer0")
    assert result.reproducible is False and result.reason is not None
    assert result.reason.startswith(
        "optimizer step 1 differs between 1 and 2 processes (rank 1 of the run on 2 processes)"
    )
    assert WORLD_NOT_LOCATED in result.notes  # op traces of different splits are never compared


@pytest.mark.parametrize(
    ("name", "unmatched", "words"),
    [
        ("grad:fc.weight", False, "the gradients the step used already differ"),
        ("state:fc.weight:momentum_buffer", False, "although the gradients the step used are equal"),
        (None, True, "did not take the same optimizer steps"),
        (None, False, "optimizer step 0 differs between 1 and 2 processes"),
    ],
)
def test_why_runs_on_different_world_sizes_part(name: str | None, unmatched: bool, words: str) -> None:
    d = Divergence(step=0, rank=1, kind="compute", key="optimizer0", name=name, unmatched=unmatched)
    assert words in world_divergence_reason(WorldScope(1, 2), d)
    init = Divergence(step=0, rank=0, kind="init", key="optimizer0", name="param:fc.weight")
    assert "initial weights depend on the number of processes" in world_divergence_reason(
        WorldScope(1, 4), init
    )
    final = Divergence(step=3, rank=0, kind="compute", key=FINAL_KEY, name="final:model.bn.running_mean")
    assert "state at exit of model differs" in world_divergence_reason(WorldScope(1, 2), final)


def test_a_rank_missing_from_the_larger_world_diverges(tmp_path: Path) -> None:
    one, two = world_records(tmp_path, ranks=1)  # settings say 2 processes; rank 1 wrote nothing
    result = compare_runs(one, two)
    d = result.first_divergence
    assert d is not None and (d.rank, d.kind) == (1, "init") and result.reproducible is False


def test_no_optimizer_step_across_world_sizes_is_inconclusive(tmp_path: Path) -> None:
    # batches and backward() steps alone say nothing about whether the result depends on the split
    one = make_record(
        tmp_path / "one", {0: split_training(2, world=1, rank=0)[1:4]}, settings=RunSettings(nproc=1)
    )
    two = make_record(
        tmp_path / "two",
        {r: split_training(2, world=2, rank=r)[1:4] for r in range(2)},
        settings=RunSettings(nproc=2),
    )
    result = compare_runs(one, two)
    assert result.reproducible is None and result.first_divergence is None
    assert result.reason is not None and result.reason.startswith(
        "no optimizer step was compared on any rank"
    )


def test_a_world_cursor_skips_what_may_differ_as_events_arrive() -> None:
    a: list[Event] = []
    b: list[Event] = []
    cursor = world_cursor(1, a, b)
    a.extend(split_training(2, world=1, rank=0))
    b.extend(split_training(2, world=2, rank=1)[:6])  # init, 2 batches, 2 backward, step 0
    assert cursor.advance() is None and cursor.position == 2  # init and step 0 compared
    b.extend(split_training(2, world=2, rank=1, fps={1: "x"})[6:])
    d = cursor.advance()
    assert d is not None and (d.kind, d.step, d.index) == ("compute", 1, 2)


def test_fewer_optimizer_steps_on_another_world_size_is_named(tmp_path: Path) -> None:
    one = make_record(
        tmp_path / "one", {0: split_training(3, world=1, rank=0)}, settings=RunSettings(nproc=1)
    )
    two = make_record(
        tmp_path / "two",
        {r: split_training(2, world=2, rank=r) for r in range(2)},
        settings=RunSettings(nproc=2),
    )
    result = compare_runs(one, two)
    d = result.first_divergence
    assert d is not None and d.unmatched and (d.kind, d.step) == ("compute", 2)
    assert result.reason is not None and "did not take the same optimizer steps" in result.reason


def test_the_state_at_exit_is_not_told_apart_by_backward_calls_across_world_sizes(tmp_path: Path) -> None:
    # no optimizer: the final event's step counts backward() calls, one per micro-batch (8 on 1
    # process, 4 on each of 2); equal states at exit must not diverge on that count
    def manual(world: int) -> list[Event]:
        steps = [ev(i, "compute", BACKWARD_KEY, i, f"g{i}") for i in range(8 // world)]
        return [
            ev(0, "init", BACKWARD_KEY, 0, "init"),
            *steps,
            ev(9, "compute", FINAL_KEY, 8 // world, "end"),
        ]

    one = make_record(tmp_path / "one", {0: manual(1)}, settings=RunSettings(nproc=1))
    two = make_record(tmp_path / "two", {0: manual(2), 1: manual(2)}, settings=RunSettings(nproc=2))
    result = compare_runs(one, two)
    assert result.first_divergence is None and result.reproducible is None  # no optimizer step compared
    assert result.coverage is not None and result.coverage.per_kind == {"final": 2, "init": 2}
