"""Verdicts in words: the lines ``check`` prints and ``torchrepro.testing`` raises."""

from __future__ import annotations

from dataclasses import replace

import pytest

from torchrepro.check import CheckResult
from torchrepro.results import Coverage, Divergence
from torchrepro.verdict import describe_check, describe_divergence


def test_describe_divergence() -> None:
    d = Divergence(step=3, rank=0, kind="compute", key="optimizer0")
    assert describe_divergence(d) == "compute at step 3"
    assert describe_divergence(replace(d, rank=2)) == "compute at step 3, rank 2"
    located = replace(d, op="aten.mm", module="fc", location="t.py:9")
    assert describe_divergence(located) == "compute at step 3; op aten.mm, module fc, location t.py:9"
    grad = replace(located, name="grad:fc.weight", shape=(2, 3), dtype="float32")
    assert describe_divergence(grad) == (
        "compute at step 3; first differing: gradient of fc.weight float32[2, 3], "
        "op aten.mm, module fc, location t.py:9"
    )
    state = replace(d, key="optimizer1", name="state:fc.bias:exp_avg")
    assert describe_divergence(state) == (
        "compute at step 3 (of optimizer1); first differing: optimizer state 'exp_avg' of fc.bias"
    )
    data = Divergence(step=0, rank=0, kind="data", key="loader1", location="t.py:1", name='["ids"]')
    assert describe_divergence(data) == (
        'data at batch 0 (of loader1); first differing: batch field ["ids"], loader created at t.py:1'
    )
    init = Divergence(step=0, rank=0, kind="init", key="backward", name="param:enc.weight")
    assert describe_divergence(init) == (
        "init at step 0 (parameters at the first backward()); first differing: parameter enc.weight"
    )


COVERED = Coverage(per_rank={0: {"init": 1, "compute": 4}}, ranks_expected=(0,))


def test_describe_check_names_the_step_op_line_and_coverage() -> None:
    d = Divergence(step=3, rank=0, kind="compute", key="optimizer0", op="aten.mm", location="t.py:9")
    result = CheckResult(
        reproducible=False,
        runs=2,
        steps_compared=4,
        first_divergence=d,
        check_dir="/c/1",
        coverage=COVERED,
        varied="1 vs 2 threads",
    )
    assert describe_check(result) == [
        "NOT reproducible: first divergence: compute at step 3; op aten.mm, location t.py:9",
        "  (4 training steps compared; varied: 1 vs 2 threads)",
        "  events compared: 1 init, 0 data, 4 compute, 0 record",
    ]


def test_describe_check_refuses_a_check_that_did_not_run() -> None:
    failed = CheckResult(
        reproducible=None, runs=2, steps_compared=0, first_divergence=None, check_dir="/c", error="x"
    )
    with pytest.raises(ValueError, match="failed to run"):
        describe_check(failed)
