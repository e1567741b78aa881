"""The compiled side's locator (``tracing.compiled``): real ``torch.compile`` with Inductor, in-process.

Each case compiles a tiny model with a fresh Inductor cache, once per module (fixtures), between
``torch._dynamo.reset()`` calls: Inductor's own random numbers (``fallback_random`` off) are named
at the dropout; with ``fallback_random`` on the dropout is never named and the probe changes no
bit of the run; outside ``start()``/``stop()`` nothing is shadowed; the reader round-trips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import marked_line
from torchrepro.errors import TraceError
from torchrepro.tracing.compiled import CompiledLocation, CompiledProbe, read_compiled_probe

HERE = Path(__file__)
DROPOUT = "torch.nn.functional.dropout"


def _line(marker: str) -> str:
    """``file:line`` of the line ending with ``# marker``, as the probe shows it (relative to cwd)."""
    return f"{os.path.relpath(HERE, os.getcwd())}:{marked_line(HERE, marker)}"


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # forward-def
        h = self.drop(self.lin(x))  # drop-call
        loss: torch.Tensor = self.head(torch.relu(h)).pow(2).mean()
        return loss


@dataclass
class Run:
    """One compiled run of ``DropNet``: the probe's file and what the run computed."""

    probe: CompiledProbe
    location: CompiledLocation | None
    losses: list[torch.Tensor]  # per step: the compiled loss
    eager_loss: torch.Tensor | None  # the uncompiled model's loss at the probed step
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]]  # at the probed step: (compiled, eager)
    params: list[torch.Tensor]  # after the last step
    rng: list[torch.Tensor]  # per step: the RNG state after its backward
    idle: dict[str, Any]  # the file of a stop() without start() after a step


@pytest.fixture(scope="module")
def inductor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A fresh Inductor cache for the module; Dynamo reset before and after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor-cache")))
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


def _train(
    directory: Path, *, fallback_random: bool, probe: bool, steps: int = 2, probed_step: int = 0
) -> Run:
    """Train ``DropNet`` compiled for ``steps`` steps (one unprobed warm-up first: the compile),
    shadowing ``probed_step`` when ``probe``; the RNG state is the caller's again after."""
    from torch._inductor import config

    torch._dynamo.reset()
    located = CompiledProbe(directory / "probe.json", keep_eager=True)
    if probe:
        located.install()
    losses: list[torch.Tensor] = []
    rng: list[torch.Tensor] = []
    eager_loss = None
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    idle: dict[str, Any] = {}
    try:
        with torch.random.fork_rng(devices=[]), config.patch(fallback_random=fallback_random):
            torch.manual_seed(0)
            model = DropNet()
            compiled = torch.compile(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            x = torch.randn(32, 8)
            compiled(x).backward()  # warm-up: the compile, then one call straight through
            model.zero_grad()
            if probe:
                idle = json.loads((located.stop()).read_text())
            for step in range(steps):
                torch.manual_seed(100 + step)
                if probe and step == probed_step:
                    located.start()
                loss = compiled(x)
                loss.backward()
                rng.append(torch.get_rng_state())
                if probe and step == probed_step:
                    located.stop()
                    compiled_grads = {
                        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
                    }
                    model.zero_grad()
                    torch.manual_seed(100 + step)
                    eager = model(x)  # the same weights and RNG state, uncompiled
                    eager.backward()
                    eager_loss = eager.detach()
                    for name, p in model.named_parameters():
                        assert p.grad is not None
                        grads[name] = (compiled_grads[name], p.grad.clone())
                        p.grad.copy_(compiled_grads[name])  # the step goes on as compiled
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.detach())
    finally:
        located.remove()
        torch._dynamo.reset()
    location = read_compiled_probe(located.path) if probe else None
    params = [p.detach().clone() for p in model.parameters()]
    return Run(located, location, losses, eager_loss, grads, params, rng, idle)


@pytest.fixture(scope="module")
def inductor_random(inductor: None, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``fallback_random`` off: Inductor draws its own dropout masks."""
    return _train(tmp_path_factory.mktemp("own"), fallback_random=False, probe=True)


@pytest.fixture(scope="module")
def inductor_random_plain(inductor: None, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``fallback_random`` off, without the probe."""
    return _train(tmp_path_factory.mktemp("own-plain"), fallback_random=False, probe=False)


@pytest.fixture(scope="module")
def eager_random(inductor: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    """``fallback_random`` on, with the probe and without it."""
    probed = _train(tmp_path_factory.mktemp("probed"), fallback_random=True, probe=True)
    plain = _train(tmp_path_factory.mktemp("plain"), fallback_random=True, probe=False)
    return probed, plain


# --------------------------------------------------------------------------------------------
# fallback_random off: the dropout is named
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_inductor_random_is_named_at_the_dropout(inductor_random: Run) -> None:
    location = inductor_random.location
    assert location is not None and location.found, location
    assert (location.graph, location.call, location.phase) == (0, 0, "forward")
    assert location.node_found
    assert (location.op, location.module, location.line) == (DROPOUT, "drop", _line("drop-call"))
    assert location.code == f"{_line('forward-def')} forward"
    assert location.random_ops == (DROPOUT,) and location.fallback_random is False
    assert location.inductor_random
    assert location.largest is not None and location.largest > 0
    assert location.notes == ()


@pytest.mark.slow
def test_the_shadow_is_eager_and_the_compiled_loss_differs(inductor_random: Run) -> None:
    """Negative control: the probe's eager side computes what the uncompiled model does, bit for
    bit, and the compiled loss does differ (so the probe had something to find)."""
    (graph, outputs), *rest = inductor_random.probe.eager_outputs
    assert graph == 0 and rest == []
    assert inductor_random.eager_loss is not None
    assert torch.equal(outputs[0], inductor_random.eager_loss)
    assert not torch.equal(inductor_random.losses[0], inductor_random.eager_loss)


@pytest.mark.slow
def test_calls_outside_start_and_stop_are_not_shadowed(inductor_random: Run) -> None:
    """The warm-up step ran compiled with the probe installed, not started: nothing shadowed."""
    idle = inductor_random.idle
    assert (idle["calls"], idle["backwards"], idle["first"]) == (0, 0, None)
    assert [g["index"] for g in idle["graphs"]] == [0]


# --------------------------------------------------------------------------------------------
# fallback_random on: never the dropout, and the probe changes nothing
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fallback_random_never_names_the_dropout(eager_random: tuple[Run, Run]) -> None:
    location = eager_random[0].location
    assert location is not None
    assert location.op != DROPOUT
    assert location.random_ops == (DROPOUT,) and location.fallback_random is True
    assert not location.inductor_random
    assert location.calls == 1
    if location.found and location.phase == "forward":
        assert location.node_found and location.op is not None  # a numeric op
    assert location.notes == () or location.phase == "backward", location.notes


@pytest.mark.slow
def test_what_the_probe_says_is_what_the_run_shows(eager_random: tuple[Run, Run]) -> None:
    """Control: the graph's one output is the loss, so the forward matched exactly when the compiled
    loss equals the uncompiled model's; a gradient named in the backward differs from eager's, and
    none differs when nothing was found."""
    probed = eager_random[0]
    location = probed.location
    assert location is not None and probed.eager_loss is not None
    forward_matched = not location.found or location.phase == "backward"
    assert torch.equal(probed.losses[0], probed.eager_loss) is forward_matched
    differing = {name for name, (c, e) in probed.grads.items() if not torch.equal(c, e)}
    if location.phase == "backward":
        assert location.name in differing
        assert location.backwards == 1
    elif not location.found:
        assert differing == set()
    assert all("failed" not in note for note in location.notes), location.notes


@pytest.mark.slow
def test_the_shadow_matches_the_compiled_dropout_with_fallback_random(eager_random: tuple[Run, Run]) -> None:
    """The eager shadow draws the same dropout mask as the compiled call: same RNG state at the
    start of both, and the compiled call's state is restored after the shadow."""
    probed = eager_random[0]
    (_, outputs), *_ = probed.probe.eager_outputs
    assert probed.eager_loss is not None and torch.equal(outputs[0], probed.eager_loss)


def _assert_same_run(probed: Run, plain: Run) -> None:
    assert len(probed.losses) == len(plain.losses) == 2
    for a, b in zip(probed.losses, plain.losses, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(probed.params, plain.params, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(probed.rng, plain.rng, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_the_probe_changes_nothing_in_the_run(eager_random: tuple[Run, Run]) -> None:
    _assert_same_run(*eager_random)


@pytest.mark.slow
def test_the_bisection_changes_nothing_in_the_run(inductor_random: Run, inductor_random_plain: Run) -> None:
    """The bisection runs prefixes from the call's RNG state; the run goes on from the state the
    compiled call left (the step after the probed one draws the same masks)."""
    assert inductor_random.location is not None and inductor_random.location.node_found
    _assert_same_run(inductor_random, inductor_random_plain)


# --------------------------------------------------------------------------------------------
# The reader
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_reader_round_trips_the_probes_file(inductor_random: Run) -> None:
    doc = json.loads(inductor_random.probe.path.read_text())
    location = read_compiled_probe(inductor_random.probe.path)
    assert location is not None
    first = doc["first"]
    assert (location.graph, location.op, location.module, location.line, location.largest) == (
        first["graph"],
        first["op"],
        first["module"],
        first["line"],
        first["largest"],
    )
    assert location.code == doc["graphs"][0]["code"] and location.graphs == 1
    assert location.describe() == (
        f"{DROPOUT} in drop at {_line('drop-call')} (compiled graph 0 of forward at "
        f"{_line('forward-def')}; largest difference {first['largest']:.3g})"
    )


def _doc(first: object, **changes: object) -> dict[str, object]:
    graph = {"index": 0, "code": "m.py:3 step", "ops": 4, "random_ops": [], "fallback_random": True}
    return {
        "format": 1,
        "graphs": [graph],
        "calls": 2,
        "backwards": 1,
        "first": first,
        "notes": [],
        **changes,
    }


def _first(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "graph": 0, "call": 1, "phase": "forward", "output": 0, "op": None, "node": None, "module": None,
        "line": None, "name": None, "largest": None, "node_found": False,
    }  # fmt: skip
    return {**base, **fields}


@pytest.mark.parametrize(
    ("first", "described"),
    [
        (None, "2 compiled forward call(s) and 1 backward call(s) matched eager bit for bit"),
        (
            _first(op="torch.add", module="Net", line="m.py:5", largest=0.5, node_found=True),
            "torch.add in Net at m.py:5 (compiled graph 0 of step at m.py:3; largest difference 0.5)",
        ),
        (
            _first(largest=2.0),
            "output 0 of compiled graph 0 of step at m.py:3 (call 1 of the step; no single op pinned; "
            "largest difference 2)",
        ),
        (
            _first(phase="backward", output=2, name="lin.weight", largest=1e-07),
            "the gradient of lin.weight in the compiled backward of compiled graph 0 of step at m.py:3 "
            "(call 1 of the step; largest difference 1e-07)",
        ),
    ],
    ids=["none", "op", "graph-only", "backward"],
)
def test_describe_reads_well(tmp_path: Path, first: dict[str, object] | None, described: str) -> None:
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(_doc(first)))
    location = read_compiled_probe(path)
    assert location is not None
    assert location.found is (first is not None)
    assert location.describe() == described


def test_a_missing_file_reads_as_none(tmp_path: Path) -> None:
    assert read_compiled_probe(tmp_path / "absent.json") is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "not a JSON object"),
        (json.dumps(_doc(None, format=2)), "format is 2, expected 1"),
        (json.dumps(_doc(None, calls="2")), "'calls' is str, expected int"),
        (json.dumps(_doc([1])), "'first' is neither null nor an object"),
        (json.dumps(_doc(_first(graph=None))), "'graph' is NoneType, expected int"),
    ],
    ids=["syntax", "array", "format", "calls", "first", "graph"],
)
def test_a_corrupt_file_raises_one_clear_error(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "probe.json"
    path.write_text(text)
    with pytest.raises(TraceError, match="compiled probe's file") as info:
        read_compiled_probe(path)
    assert str(path) in str(info.value) and problem in str(info.value)
    assert info.value.__suppress_context__


def test_the_reader_imports_no_torch() -> None:
    code = "import sys, torchrepro.tracing.compiled; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# no random op: the bisection pins Inductor's arithmetic
# --------------------------------------------------------------------------------------------


class NormNet(nn.Module):
    """No random op; Inductor's fused GELU and layer norm round differently from eager's kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(nn.functional.gelu(self.lin(x)))  # norm-call
        return self.head(h)


@dataclass
class Bisected:
    found: CompiledLocation | None
    differs: bool  # the control: the compiled forward is not eager's
    steps: list[str]  # the ops of the forward in order
    alone: list[bool]  # per op: the forward up to it, compiled alone, equals eager's


@pytest.fixture(scope="module")
def bisected(inductor: None, tmp_path_factory: pytest.TempPathFactory) -> Bisected:
    path = tmp_path_factory.mktemp("bisect") / "probe.json"
    torch._dynamo.reset()
    probe = CompiledProbe(path)
    probe.install()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = NormNet()
            compiled = torch.compile(model)
            x = torch.randn(4, 12, 32)
            compiled(x).sum().backward()  # the compile
            probe.start()
            out = compiled(x)
            out.sum().backward()
            probe.stop()
    finally:
        probe.remove()
        torch._dynamo.reset()
    prefixes = {
        "torch.nn.functional.linear": lambda t: model.lin(t),
        "torch.nn.functional.gelu": lambda t: nn.functional.gelu(model.lin(t)),
        "torch.nn.functional.layer_norm": lambda t: model.norm(nn.functional.gelu(model.lin(t))),
    }
    with torch.no_grad():
        differs = not torch.equal(out, model(x))
        alone = [torch.equal(torch.compile(f)(x), f(x)) for f in prefixes.values()]
    torch._dynamo.reset()
    return Bisected(read_compiled_probe(path), differs, list(prefixes), alone)


@pytest.mark.slow
def test_the_bisection_names_the_first_op_whose_compiled_value_differs(bisected: Bisected) -> None:
    """A forward that differs without randomness is bisected to one node: the op named is one whose
    compiled value really differs from eager's when compiled alone from the same input (the ground
    truth, outside the probe), and no op before it does."""
    found = bisected.found
    assert bisected.differs  # the control: compiling changes this forward
    assert found is not None and found.found and found.phase == "forward" and found.node_found
    assert found.random_ops == () and found.largest is not None and found.largest > 0
    assert found.line == _line("norm-call")
    assert found.op in bisected.steps, found
    named = bisected.steps.index(found.op)
    assert bisected.alone[:named] == [True] * named and bisected.alone[named] is False, (found, bisected)
