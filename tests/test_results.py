"""``results``: the one ``Outcome`` every verdict is read through."""

from __future__ import annotations

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
