"""``compare.resume.align_resumed``: a restarted run aligned with the uninterrupted one by state, on
events built by hand (every path: exact, each kind of difference, nothing restored, no alignment).

The runs: 6 optimizer steps, one batch each; the parameters after step ``j`` are ``p<j>`` (``p0``:
the start), the optimizer state ``s<j>``, the RNG state before step ``j`` ``r<j>``.
"""

from __future__ import annotations

from typing import Any

import pytest

from torchrepro.compare.resume import align_resumed

STEPS = 6


def _step(
    j: int, *, batch: str | None = None, grad: str | None = None, param: str | None = None
) -> list[dict[str, Any]]:
    """The events of step ``j``: its batch, then the optimizer step (gradient, state, parameter)."""
    leaves = [
        {"n": "grad:w", "fp": grad or f"g{j}", "shape": [2], "dtype": "float32"},
        {"n": "state:w:momentum_buffer", "fp": f"s{j + 1}", "shape": [2], "dtype": "float32"},
        {"n": "param:w", "fp": param or f"p{j + 1}", "shape": [2], "dtype": "float32"},
    ]
    fp = "|".join(e["fp"] for e in leaves)
    return [
        {"kind": "data", "key": "loader0", "step": j, "fp": batch or f"b{j}", "t": [], "src": "t.py:3"},
        {"kind": "compute", "key": "optimizer0", "step": j, "fp": fp, "t": leaves},
    ]


def _final(fp: str = "f") -> list[dict[str, Any]]:
    return [{"kind": "compute", "key": "final", "step": STEPS, "fp": fp, "t": []}]


def _init() -> list[dict[str, Any]]:
    return [{"kind": "init", "key": "optimizer0", "step": 0, "fp": "i", "t": []}]


def _state(
    j: int, *, first: bool = False, param: str | None = None, opt: str | None = "", rng: str = ""
) -> dict[str, Any]:
    state: dict[str, Any] = {"step": j, "rng": {"torch": rng or f"r{j}"}}
    if first:
        t = [{"n": "param:w", "fp": param or f"p{j}"}]
        if opt is not None and j > 0:
            t.insert(0, {"n": "state:w:momentum_buffer", "fp": opt or f"s{j}"})
        state["t"] = t
    return state


def _run_a() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    events = _init() + [e for j in range(STEPS) for e in _step(j)] + _final()
    states = [_state(j, first=j == 0) for j in range(STEPS)]
    return events, states


def _restart(at: int, **changes: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The restart from the state after ``at`` steps, as it records it (its own steps from 0)."""
    events = _init() + [e for j in range(at, STEPS) for e in _step(j)] + _final()
    states = [_state(j, first=j == at) for j in range(at, STEPS)]
    for i, e in enumerate(events):  # a restarted run counts from 0
        if e["kind"] == "compute" and e["key"] == "optimizer0":
            events[i] = {**e, "step": e["step"] - at}
    return events, states


def _align(b: tuple[list[dict[str, Any]], list[dict[str, Any]]], kill: int = 3, final: bool = True) -> Any:
    a_events, a_states = _run_a()
    return align_resumed(a_events, a_states, *b, rank=0, kill_after=kill, compare_final=final)


@pytest.mark.parametrize("at", [1, 2, 3])
def test_a_restart_from_any_step_up_to_the_kill_is_aligned_and_exact(at: int) -> None:
    found = _align(_restart(at))
    assert (found.restored_at, found.steps_compared, found.divergence, found.problem) == (
        at,
        STEPS - at,
        None,
        None,
    )


def test_a_restart_from_a_state_after_the_kill_is_not_aligned() -> None:
    found = _align(_restart(4), kill=3)  # it cannot have saved after a step it never took
    assert found.restored_at is None
    assert "none the first run had after steps 1..3" in found.problem
    assert "closest: the first run after step 3" in found.problem


def test_a_restart_from_the_start_restored_nothing() -> None:
    events, states = _restart(0)
    found = _align((events, states))
    assert found.restored_at is None and "restored nothing" in found.problem


def test_a_partial_restore_names_the_closest_step() -> None:
    events, states = _restart(2)
    states[0]["t"][-1]["fp"] = "p-other"
    found = _align((events, states))
    assert found.restored_at is None
    assert "0 of 1 parameter tensors equal; the first that differs: parameter w" in found.problem


def test_an_optimizer_state_not_restored_is_the_divergence_at_the_resumed_step() -> None:
    events, states = _restart(2)
    states[0]["t"] = [e for e in states[0]["t"] if not e["n"].startswith("state:")]
    found = _align((events, states))
    d = found.divergence
    assert (d.step, d.kind, d.name, d.shape, d.dtype) == (
        2,
        "compute",
        "state:w:momentum_buffer",
        (2,),
        "float32",
    )
    assert "was not restored" in found.explanation


def test_a_different_batch_is_a_data_divergence_with_the_loaders_position_named() -> None:
    events, states = _restart(2)
    i = next(i for i, e in enumerate(events) if e["kind"] == "data" and e["step"] == 3)
    events[i] = {**events[i], "fp": "other batch"}
    found = _align((events, states))
    assert (found.divergence.kind, found.divergence.step, found.steps_compared) == ("data", 3, 2)
    assert "the loader did not resume at its position" in found.explanation
    assert "RNG" not in found.explanation


def test_a_gradient_that_differs_with_another_rng_state_names_the_rng() -> None:
    events, states = _restart(2)
    i = next(i for i, e in enumerate(events) if e["kind"] == "compute" and e["key"] == "optimizer0")
    events[i]["t"][0]["fp"] = "other grad"
    events[i] = {**events[i], "fp": "other"}
    states[0]["rng"]["torch"] = "another stream"
    found = _align((events, states))
    assert (found.divergence.step, found.divergence.name) == (2, "grad:w")
    assert "torch's CPU RNG state before step 2 is not the first run's" in found.explanation


def test_skipped_batches_read_before_the_first_step_are_not_compared() -> None:
    events, states = _restart(2)
    skipped = [{"kind": "data", "key": "loader0", "step": k, "fp": f"b{k}", "t": []} for k in range(2)]
    events[1:1] = skipped  # a script that reads the batches it skips
    assert _align((events, states)).divergence is None


def test_a_restart_that_ends_early_or_goes_on_or_ends_elsewhere_differs() -> None:
    events, states = _restart(2)
    short = [
        e for e in events if not (e["kind"] == "compute" and e["key"] == "optimizer0" and e["step"] == 3)
    ]
    short = [e for e in short if not (e["kind"] == "data" and e["step"] == 5)]
    found = _align((short, states))
    assert found.divergence is not None and "ended after 3 optimizer step(s)" in found.explanation
    longer = events[:-1] + _step(6) + _final()
    found = _align((longer, states))
    assert found.divergence is not None and "only 4 were left" in found.explanation
    other_end = events[:-1] + _final("f2")
    found = _align((other_end, states))
    assert found.divergence.kind == "compute" and found.divergence.key == "final"
    assert _align((other_end, states), final=False).divergence is None  # --steps: the end is not compared


def test_no_optimizer_step_is_a_problem_not_a_pass() -> None:
    assert "took no optimizer step" in _align((_init(), [])).problem


def test_an_update_that_differs_with_the_same_gradients_names_the_learning_rate() -> None:
    events, states = _restart(2)
    i = next(i for i, e in enumerate(events) if e["kind"] == "compute" and e["key"] == "optimizer0")
    events[i]["t"][1]["fp"] = "other state"  # the momentum after the update, not the gradient
    events[i] = {**events[i], "fp": "other"}
    found = _align((events, states))
    assert (found.divergence.step, found.divergence.name) == (2, "state:w:momentum_buffer")
    assert "a learning-rate scheduler not restored?" in found.explanation
