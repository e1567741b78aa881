"""``check --repro`` in-process: capturing an op call exactly, and the script written from it.

The script is run the way a user attaches it upstream: a fresh, isolated python (``-I``) in the
directory, with no ``PYTHONPATH`` (no torchrepro on the path). A whole-tensor sum of 2**20 float32
values is split by the thread count; one of 1000 values is not (below torch's grain size): the
script shows the first and, the negative control, not the second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchrepro import runrecord
from torchrepro.tracing import Tracer
from torchrepro.tracing.capture import CaptureRequest
from torchrepro.tracing.ops import OpDivergence
from torchrepro.tracing.repro import INPUTS_FILE, REPEAT_CALLS, SCRIPT_FILE, Target, target, write_repro


def _capture(tmp_path: Path, fn: object, *args: torch.Tensor, index: int = 0) -> tuple[Path, Path]:
    """Trace ``fn(*args)`` as a check's traced run does, saving op ``index``'s inputs: the trace
    directory and the capture prefix."""
    prefix = tmp_path / "capture"
    tensors, call = runrecord.capture_paths(prefix, 0)
    with Tracer(runrecord.trace_path(tmp_path / "trace-a", 0), capture=CaptureRequest(index, tensors, call)):
        fn(*args)  # type: ignore[operator]
    return tmp_path, prefix


def _target(traces: Path, op: str, *, index: int = 0, threads: tuple[int, int] | None) -> Target:
    located = OpDivergence(op=op, module=None, location=None, backward=False, index=index, inputs_equal=True)
    return Target(op=located, rank=0, traces=traces, threads=threads)


def run_clean(directory: Path) -> subprocess.CompletedProcess[str]:
    """``python -I repro.py`` in ``directory`` with no PYTHONPATH, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TORCHREPRO_"))}
    return subprocess.run(
        [sys.executable, "-I", SCRIPT_FILE],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(("size", "differs"), [(2**20, True), (1000, False)])
def test_the_script_shows_a_thread_dependent_sum_and_not_a_deterministic_one(
    tmp_path: Path, size: int, differs: bool
) -> None:
    x = torch.randn(size, generator=torch.Generator().manual_seed(0))
    traces, prefix = _capture(tmp_path, torch.sum, x)
    out = tmp_path / "repro"
    chosen = _target(traces, "aten.sum.default", threads=(1, 2))
    written = write_repro(out, chosen, prefix, where="in a test", run=False)  # run below, as a user does
    assert not isinstance(written, str), written
    assert (written.op, written.calls, written.reproduces) == ("aten.sum.default", (1, 1, 2), None)
    proc = run_clean(out)
    assert proc.returncode == (1 if differs else 0), proc.stdout + proc.stderr
    if differs:
        assert "call 3 (2 threads) vs call 1 (1): output 0: 1 of 1 elements differ" in proc.stdout
        assert "the difference reproduces" in proc.stdout
    else:
        assert "no difference: every call gave the same bits" in proc.stdout
    assert f"torch {torch.__version__}" in proc.stdout
    script = (out / SCRIPT_FILE).read_text()
    assert "OP = torch.ops.aten.sum.default" in script and "torchrepro" not in script.split('"""', 2)[2]


def test_an_op_whose_calls_agree_is_called_repeatedly_and_does_not_reproduce(tmp_path: Path) -> None:
    """Negative control of the other kind of script: same settings, several calls."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    traces, prefix = _capture(tmp_path, torch.mm, a, b)
    written = write_repro(
        tmp_path / "r", _target(traces, "aten.mm.default", threads=None), prefix, where="here"
    )
    assert not isinstance(written, str), written
    assert len(written.calls) == REPEAT_CALLS and written.reproduces is False  # run by write_repro


def test_a_capture_keeps_strides_offset_and_values_before_an_in_place_write(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    view = base.t()[1:]  # not contiguous, storage offset 1
    before = view.clone()

    def write(v: torch.Tensor) -> None:
        v.add_(1.5)

    _capture(tmp_path, write, view)
    tensors, call = runrecord.capture_paths(tmp_path / "capture", 0)
    (saved,) = torch.load(tensors, weights_only=True)
    assert (saved.stride(), saved.storage_offset(), saved.dtype) == (view.stride(), 1, torch.float32)
    assert torch.equal(saved, before) and not torch.equal(saved, view)
    doc = json.loads(call.read_text())
    assert (doc["op"], doc["args"], doc["index"]) == ("aten.add_.Tensor", "T[0], 1.5", 0)


def test_non_tensor_arguments_are_written_as_source(tmp_path: Path) -> None:
    x = torch.ones(2, 3)
    _capture(tmp_path, lambda t: torch.sum(t, dim=[1], keepdim=True, dtype=torch.float64), x)
    doc = json.loads(runrecord.capture_paths(tmp_path / "capture", 0)[1].read_text())
    assert doc["args"] == "T[0], [1], True, dtype=torch.float64"
    assert doc["tensors"] == ["float32[2, 3] on cpu"]


def test_a_random_op_is_refused_with_the_reason(tmp_path: Path) -> None:
    x = torch.full((4,), 0.5)
    _capture(tmp_path, lambda t: torch.bernoulli(t, generator=torch.Generator().manual_seed(0)), x)
    tensors, call = runrecord.capture_paths(tmp_path / "capture", 0)
    assert "draws from a random number generator" in json.loads(call.read_text())["refused"]
    assert not tensors.exists()


def test_inputs_other_than_the_located_ones_write_nothing(tmp_path: Path) -> None:
    """The capture must be of the located call: the located trace (trace-a) saw other inputs."""
    traces, prefix = _capture(tmp_path, torch.sum, torch.ones(10))
    other = torch.zeros(10)
    with Tracer(runrecord.trace_path(tmp_path / "trace-a", 0)):
        torch.sum(other)
    why = write_repro(tmp_path / "r", _target(traces, "aten.sum.default", threads=(1, 2)), prefix, where="")
    assert isinstance(why, str) and "saw other inputs" in why
    assert not (tmp_path / "r").exists()
    assert not (tmp_path / "r" / INPUTS_FILE).exists()


def _traces(tmp_path: Path, a: object, b: object) -> Path:
    for side, fn in (("a", a), ("b", b)):
        with Tracer(runrecord.trace_path(tmp_path / f"trace-{side}", 0)):
            fn()  # type: ignore[operator]
    return tmp_path


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("not located", "no op was located"),
        ("inputs differ", "an input of aten.mul.Tensor already differed between the runs"),
        ("control flow", "the runs issued different ops at step 3 (aten.mul.Tensor vs aten.add.Tensor)"),
        ("random op", "aten.bernoulli.default draws from a random number generator"),
    ],
)
def test_a_divergence_no_single_call_shows_gets_the_reason(tmp_path: Path, case: str, why: str) -> None:
    x = torch.ones(3)
    runs = {
        "inputs differ": (lambda: x * 2.0, lambda: x * 3.0),
        "control flow": (lambda: x * 2.0, lambda: x + 2.0),
        "random op": (
            lambda: torch.bernoulli(torch.full((8,), 0.5), generator=torch.Generator().manual_seed(0)),
            lambda: torch.bernoulli(torch.full((8,), 0.5), generator=torch.Generator().manual_seed(1)),
        ),
    }
    traces = None if case == "not located" else _traces(tmp_path, *runs[case])
    chosen = target(3, 0, traces, threads=(1, 2))
    assert isinstance(chosen, str) and chosen.startswith(why), chosen
