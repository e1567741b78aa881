"""The event vocabulary (``torchrepro.events``): keys, kinds, and the one rule that orders divergences."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrepro.compare import compare_runs
from torchrepro.events import (
    BACKWARD_KEY,
    EVENT_KINDS,
    FINAL_KEY,
    counted_kind,
    describe_name,
    divergence_order,
    earliest,
    in_order,
    is_step,
    optimizer_index,
    optimizer_key,
    world_invariant,
)
from torchrepro.results import Divergence
from torchrepro.runrecord import events_path

# --- keys ----------------------------------------------------------------------------------------


@settings(deadline=None)
@given(st.integers(0, 10**6))
def test_optimizer_index_of_an_optimizer_key(n: int) -> None:
    assert optimizer_index(optimizer_key(n)) == n == optimizer_index(f"optimizer{n}")


@pytest.mark.parametrize("key", [None, "", "optimizer", "loader3", "optimizer-1", "optimizer1a", "loss"])
def test_optimizer_index_of_anything_else_is_zero(key: str | None) -> None:
    assert optimizer_index(key) == 0


def test_backward_steps_are_optimizer_minus_one_and_counted_apart() -> None:
    assert optimizer_index(BACKWARD_KEY) == -1
    assert is_step("compute", "optimizer0") and not is_step("compute", "optimizer1")
    assert is_step("compute", BACKWARD_KEY, backward=True) and not is_step("compute", BACKWARD_KEY)
    assert not is_step("init", "optimizer0") and not is_step("compute", FINAL_KEY)


def test_the_state_at_exit_counts_as_final_not_as_a_step() -> None:
    assert counted_kind("compute", FINAL_KEY) == "final"
    assert counted_kind("compute", "optimizer0") == "compute"
    assert counted_kind("record", FINAL_KEY) == "record"  # a value the user named "final"


@pytest.mark.parametrize(
    ("name", "kind", "words"),
    [
        ("grad:fc.weight", "compute", "gradient of fc.weight"),
        ("param:fc.bias", "init", "parameter fc.bias"),
        ("final:fc.bias", "compute", "final value of fc.bias"),
        ("state:fc.weight:exp_avg", "compute", "optimizer state 'exp_avg' of fc.weight"),
        ("[0]", "data", "batch field [0]"),
        ("", "data", "the batch"),
        ("", "record", "the value"),
    ],
)
def test_tensor_names_in_words(name: str, kind: str, words: str) -> None:
    assert describe_name(name, kind) == words


# --- the one order of divergences ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "key", "invariant"),
    [
        ("init", "optimizer0", True),
        ("init", BACKWARD_KEY, True),
        ("compute", "optimizer1", True),
        ("compute", FINAL_KEY, True),
        ("compute", BACKWARD_KEY, False),  # one per micro-batch: their number depends on the split
        ("data", "loader0", False),  # each process loads its own part of a global batch
        ("record", "loss", False),  # a process's own value
    ],
)
def test_what_must_not_depend_on_the_world_size(kind: str, key: str, invariant: bool) -> None:
    assert world_invariant(kind, key) is invariant


def test_kinds_are_listed_in_the_order_a_rank_meets_them_within_a_step() -> None:
    assert EVENT_KINDS == ("init", "data", "record", "compute")
    at_step_1 = [Divergence(step=1, rank=0, kind=k, key="k") for k in reversed(EVENT_KINDS)]
    assert [d.kind for d in sorted(at_step_1, key=divergence_order)] == list(EVENT_KINDS)


def test_earliest_is_the_step_then_the_kind_then_the_rank() -> None:
    ds = [Divergence(step=3, rank=0, kind="compute"), Divergence(step=2, rank=1, kind="compute")]
    assert earliest(ds) == ds[1]  # the earlier step, whatever the rank
    ds.append(Divergence(step=2, rank=0, kind="compute"))
    assert earliest(ds) == ds[2]  # same step and kind: the lower rank
    ds.append(Divergence(step=2, rank=1, kind="data"))
    assert earliest(ds) == ds[3]  # same step: the batch comes before the optimizer step
    ds.append(Divergence(step=2, rank=1, kind="compute", key=FINAL_KEY))
    assert earliest(ds) == ds[3]  # the state at exit never comes before a step
    assert earliest([]) is None


def test_check_orders_runs_after_the_event_and_before_the_rank() -> None:
    d = Divergence(step=1, rank=1, kind="data")
    found = [
        (2, Divergence(step=1, rank=0, kind="compute")),
        (2, d),
        (1, Divergence(step=1, rank=1, kind="data")),
    ]
    assert [(run, x.rank, x.kind) for run, x in in_order(found)] == [
        (1, 1, "data"),
        (2, 1, "data"),
        (2, 0, "compute"),
    ]


def _events(rank_data_fp: str, compute_fp: str) -> list[dict[str, Any]]:
    def ev(kind: str, key: str, step: int, fp: str) -> dict[str, Any]:
        return {"kind": kind, "key": key, "step": step, "fp": fp, "t": []}

    return [
        ev("init", "optimizer0", 0, "i"),
        ev("data", "loader0", 0, "d0"),
        ev("compute", "optimizer0", 0, "c0"),
        ev("data", "loader0", 1, rank_data_fp),
        ev("compute", "optimizer0", 1, compute_fp),
    ]


def _record(path: Path, ranks: dict[int, list[dict[str, Any]]]) -> Path:
    path.mkdir()
    for rank, events in ranks.items():
        events_path(path, rank).write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    return path


def test_compare_names_the_event_check_names_when_ranks_part_in_different_kinds(tmp_path: Path) -> None:
    """Rank 1 reads another batch at step 1; all-reduced gradients spread it to rank 0's step 1.

    ``check`` always named rank 1's batch; ``compare`` ordered by (step, rank) and named rank 0's
    optimizer step: the same two records got two different "first divergences".
    """
    a = _record(tmp_path / "a", {0: _events("d1", "c1"), 1: _events("d1", "c1")})
    b = _record(tmp_path / "b", {0: _events("d1", "x1"), 1: _events("other", "x1")})
    d = compare_runs(a, b).first_divergence
    assert d is not None
    assert (d.step, d.rank, d.kind) == (1, 1, "data")
    assert in_order([(1, Divergence(step=1, rank=0, kind="compute")), (1, d)])[0][1] is d
