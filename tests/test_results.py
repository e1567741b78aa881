"""``results``: the one ``Outcome`` every verdict is read through."""

from __future__ import annotations

import json

import pytest

from torchrepro.results import CheckResult, Comparison, Outcome


@pytest.mark.parametrize(
    ("reproducible", "error", "outcome", "code", "words"),
    [
        (True, None, Outcome.REPRODUCIBLE, 0, "reproducible"),
        (False, None, Outcome.DIVERGED, 1, "not reproducible"),
        (None, None, Outcome.INCONCLUSIVE, 3, "inconclusive"),
        (None, "run 2 of 2 failed with exit code 1", Outcome.FAILED, 2, "failed"),
    ],
)
def test_a_check_results_outcome_exit_code_and_words(
    reproducible: bool | None, error: str | None, outcome: Outcome, code: int, words: str
) -> None:
    result = CheckResult(
        reproducible=reproducible,
        runs=2,
        steps_compared=1,
        first_divergence=None,
        check_dir="/c",
        error=error,
    )
    assert result.outcome is outcome
    assert (outcome.exit_code, outcome.words(), outcome.passed) == (
        code,
        words,
        outcome is Outcome.REPRODUCIBLE,
    )
    assert result.inconclusive is (outcome is Outcome.INCONCLUSIVE)
    assert result.to_dict()["inconclusive"] is result.inconclusive


@pytest.mark.parametrize(
    ("reproducible", "words"), [(True, "identical"), (False, "not identical"), (None, "inconclusive")]
)
def test_a_comparison_reads_its_outcome_in_its_own_words(reproducible: bool | None, words: str) -> None:
    result = Comparison(reproducible=reproducible, steps_compared=1, first_divergence=None)
    assert result.outcome.words(runs="identical") == words
    assert result.to_dict()["inconclusive"] is (reproducible is None)


def test_compile_scope_says_how_far_each_step_went() -> None:
    from torchrepro.results import CompileScope, StepGap

    steps = tuple(StepGap(s, 3, 9, 10.0 ** (s - 7), exact=s != 2) for s in range(8))
    scope = CompileScope(compiles=2, fallback_random=True, cache="/c/inductor1", steps=steps, graph="g")
    d = scope.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["largest"] == 1.0 and [s["step"] for s in d["steps"]] == list(range(8))
    text = scope.describe()
    assert "2 compilation(s)" in text and "fallback_random on" in text
    assert "0: 1e-07" in text and "2: 1e-05+" in text and "(8 steps differ)" in text
    equal = CompileScope(compiles=1, fallback_random=False, cache=None, steps=(StepGap(0, 0, 9, None),))
    assert equal.largest is None and "every recorded value equal over 1 step(s)" in equal.describe()
    result = CheckResult(
        reproducible=False, runs=2, steps_compared=1, first_divergence=None, check_dir="d", compile=scope
    )
    assert result.to_dict()["compile"] == d
    assert (
        CheckResult(reproducible=True, runs=2, steps_compared=1, first_divergence=None, check_dir="d")
        .to_dict()
        .get("compile")
        is None
    )
