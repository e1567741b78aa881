"""The op rules (``audit.op_rules``) in-process: every table entry found from a CPU run, op analysis.

The op examples run real torch ops on the CPU under the real ``OpRecorder``: each entry of the table
must be found from the ops a CPU run records (that is the point of the audit), and a plain CNN
must give no error (negative control).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchrepro.audit import AuditReport, Finding, audit_ops, op_rules
from torchrepro.audit.optable import _TABLE_FILE, _release_of, load_table
from torchrepro.errors import TraceError
from torchrepro.tracing import OpRecorder


def test_an_unreadable_documentation_falls_back_to_the_copy_and_the_audit_says_so(
    monkeypatch: pytest.MonkeyPatch, rng_changes_ok: None
) -> None:
    table = load_table(doc="Sets whether PyTorch operations must use deterministic algorithms.")
    want = _release_of(torch.__version__)
    assert not table.read and _release_of(table.release) <= want
    assert all(
        e.listed_in == table.listed_in
        for e in table.entries
        if e.section != "extra" and not (e.listed_in or "").startswith("measured on ")
    )
    monkeypatch.setattr(op_rules, "load_table", lambda: table)
    (tr001,) = [f for f in op_rules.table_findings() if f.code == "TR001"]
    assert "could not be read" in tr001.message and table.listed_in in tr001.message
    (finding,) = [f for f in audit_ops(_record(EXAMPLES["TR107"])) if f.code == "TR107"]
    assert finding.message.count(f"({table.listed_in})") == 1


# --------------------------------------------------------------------------------------------
# Every entry is found from a CPU run (real ops, real recorder)


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def _unpool() -> None:
    out, idx = nn.MaxPool2d(2, return_indices=True)(_x(1, 1, 4, 4))
    nn.MaxUnpool2d(2)(out, idx).sum().backward()


def _ctc() -> None:
    log_probs = _x(10, 2, 5).log_softmax(2)
    targets = torch.randint(1, 5, (2, 4))
    nn.CTCLoss()(log_probs, targets, torch.full((2,), 10), torch.full((2,), 4)).backward()


def _sdpa() -> None:
    q = _x(1, 2, 4, 8)
    F.scaled_dot_product_attention(q, q, q).sum().backward()


def _scatter_multiply() -> None:
    with warnings.catch_warnings():  # torch deprecates scatter's reduce argument
        warnings.simplefilter("ignore", UserWarning)
        torch.ones(3).scatter_(0, torch.tensor([0, 0, 1]), torch.rand(3), reduce="multiply")


EXAMPLES: dict[str, Callable[[], object]] = {
    "TR101": lambda: nn.AvgPool3d(2)(_x(1, 1, 4, 4, 4)).sum().backward(),
    "TR102": lambda: nn.AdaptiveAvgPool2d(3)(_x(1, 2, 6, 6)).sum().backward(),
    "TR103": lambda: nn.AdaptiveMaxPool2d(3)(_x(1, 2, 6, 6)).sum().backward(),
    "TR104": lambda: nn.FractionalMaxPool2d(2, output_size=3)(_x(1, 2, 6, 6)).sum().backward(),
    "TR105": _unpool,
    "TR106": lambda: F.interpolate(_x(1, 1, 4, 4), scale_factor=2, mode="bicubic").sum().backward(),
    "TR107": lambda: F.pad(_x(1, 1, 4), (1, 1), mode="reflect").sum().backward(),
    "TR108": lambda: F.cross_entropy(_x(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4))).backward(),
    "TR109": _ctc,
    "TR110": lambda: nn.EmbeddingBag(10, 3, mode="max")(torch.tensor([[1, 2], [3, 4]])).sum().backward(),
    "TR111": lambda: torch.zeros(5).put_(torch.tensor([1, 3]), torch.ones(2), accumulate=True),
    "TR112": lambda: torch.histc(torch.randn(10), bins=4),
    "TR113": lambda: torch.bincount(torch.tensor([1, 2, 2]), weights=torch.ones(3)),
    "TR114": lambda: torch.randn(3, 4).median(dim=1),
    "TR115": lambda: (
        F.grid_sample(_x(1, 1, 4, 4), torch.rand(1, 3, 3, 2) * 2 - 1, align_corners=False).sum().backward()
    ),
    "TR116": lambda: _x(5).cumsum(0).sum().backward(),
    "TR117": lambda: torch.ones(3).scatter_reduce(0, torch.tensor([0, 0, 1]), torch.rand(3), reduce="prod"),
    "TR119": lambda: torch.randn(3, 4).kthvalue(2, dim=1),
    "TR120": lambda: nn.Conv2d(1, 1, 3)(_x(1, 1, 5, 5)).sum().backward(),
    "TR121": lambda: nn.ReplicationPad2d(1)(_x(1, 1, 4, 4)).sum().backward(),
    "TR123": lambda: _x(5)[(torch.tensor([0, 0, 2]),)].sum().backward(),
    "TR124": lambda: _x(5).gather(0, torch.tensor([1, 1])).sum().backward(),
    "TR125": lambda: _x(5).index_select(0, torch.tensor([1, 1])).sum().backward(),
    "TR126": lambda: torch.zeros(5).index_copy_(0, torch.tensor([1, 3]), torch.ones(2)),
    "TR127": lambda: torch.zeros(5).scatter_(0, torch.tensor([1, 1]), torch.ones(2)),
    "TR129": lambda: nn.MaxPool3d(2)(_x(1, 1, 4, 4, 4)).sum().backward(),
    "TR130": _sdpa,
    "TR131": lambda: nn.Embedding(10, 3)(torch.tensor([1, 2, 2])).sum().backward(),
    "TR133": _scatter_multiply,
    "TR134": lambda: torch.randn(3, 4).nanmedian(dim=1),
}
NEEDS_ARGUMENTS = {
    # Reported only when the recording carries the call's arguments (the OpRecorder does not):
    "TR118": "resize_ matters only on quantized tensors",
    "TR122": "bmm matters only with a sparse input",
    "TR128": "scatter_reduce sum/mean vs amax/amin needs the reduce argument",
    "TR132": "scatter(reduce='add') vs reduce='multiply' needs the reduce argument",
}


def _record(fn: Callable[[], object]) -> list[Any]:
    with OpRecorder() as rec:
        fn()
    return rec.events


def test_every_entry_has_an_example_or_a_reason() -> None:
    codes = {e["code"] for e in json.loads(_TABLE_FILE.read_text())["entries"]}
    assert set(EXAMPLES) | set(NEEDS_ARGUMENTS) == codes
    assert not set(EXAMPLES) & set(NEEDS_ARGUMENTS)


_SEVERITIES = {
    "raises": {"error", "warning"},
    "unguarded": {"error", "warning"},
    "deterministic": {"info"},
    "extra": {"info"},
}


@pytest.mark.parametrize("code", sorted(EXAMPLES))
def test_entry_is_found_from_a_cpu_run_when_this_torch_documents_it(code: str, rng_changes_ok: None) -> None:
    torch.manual_seed(0)
    table = load_table()
    findings = [f for f in audit_ops(_record(EXAMPLES[code])) if f.code == code]
    entries = {e.section: e for e in table.entries if e.code == code}
    if not entries:  # documented by other releases only: not an op finding under this one
        assert findings == [], f"{code} is not in the torch {table.release} documentation, yet found"
        return
    assert findings, f"{code}: no finding from the ops of its example"
    for f in findings:
        section = "extra" if "extra" in entries else "deterministic" if f.severity == "info" else "raises"
        entry = entries[section]
        assert f.severity in _SEVERITIES[entry.section]
        if entry.section == "raises":
            # the recorder gives no arguments: a condition it cannot tell is a warning that says so
            assert f.severity == ("warning" if entry.condition is not None else "error"), f
            assert entry.condition is None or "cannot tell" in f.message
        if entry.section != "extra":
            assert f"({entry.listed_in})" in f.message, f.message
    location = findings[0].location or ""
    assert location.startswith("tests/audit/test_audit_op_rules.py:"), location


@pytest.mark.parametrize(
    ("release", "code", "example", "severities"),
    [
        ("2.13", "TR131", "TR131", set()),  # Embedding backward: only 2.14 documents it
        ("2.14", "TR131", "TR131", {"info"}),
        ("2.13", "TR116", "TR116", {"warning"}),  # cumsum raises (floating: the recording cannot tell)
        ("2.14", "TR116", "TR116", {"info"}),  # 2.14 made it deterministic
        ("2.4", "TR119", "TR119", {"error"}),  # kthvalue: only 2.4 documents it (raising)
        ("2.13", "TR119", "TR119", set()),
        ("2.4", "TR129", "TR129", {"error"}),  # MaxPool3d backward raised in 2.4
        ("2.13", "TR129", "TR129", {"info"}),
        ("2.4", "TR121", "ReplicationPad1d", {"error"}),  # 1d and 3d raised in 2.4, 2d did not
        ("2.4", "TR121", "TR121", {"info"}),
        ("2.13", "TR121", "ReplicationPad1d", {"info"}),
    ],
)
def test_an_op_counts_as_its_release_documents_it(
    release: str,
    code: str,
    example: str,
    severities: set[str],
    monkeypatch: pytest.MonkeyPatch,
    rng_changes_ok: None,
) -> None:
    table = load_table(f"{release}.0", measured=False)  # torchrepro's copy of that release's documentation
    monkeypatch.setattr(op_rules, "load_table", lambda: table)
    run = EXAMPLES.get(example) or (lambda: nn.ReplicationPad1d(1)(_x(1, 1, 4)).sum().backward())
    findings = [f for f in audit_ops(_record(run)) if f.code == code]
    assert {f.severity for f in findings} == severities
    assert all(f"(torchrepro's copy of the torch {release} documentation)" in f.message for f in findings)


def test_a_raising_op_says_where_its_documentation_says_it_raises(rng_changes_ok: None) -> None:
    events = [e for code in ("TR101", "TR105", "TR111") for e in _record(EXAMPLES[code])]
    message = {f.code: f.message for f in audit_ops(events)}
    source = f"({load_table().listed_in})"
    assert f"no deterministic implementation on CUDA {source}." in message["TR101"]  # CUDA items only
    assert f"on any device, the CPU included {source}." in message["TR105"]  # MaxUnpool: no device named
    assert f"nor on the CPU in some of the documented cases {source}." in message["TR111"]  # put_: both


def _clean_cnn_step() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1),  # computed as a mean by PyTorch: deterministic
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(8, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = F.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 10, (4,)))
    loss.backward()
    opt.step()


def test_clean_cnn_gives_no_error_and_no_warning(rng_changes_ok: None) -> None:
    events = _record(_clean_cnn_step)
    assert len(events) > 20  # the recorder saw the whole step
    findings = audit_ops(events)
    assert [f.code for f in findings] == ["TR120"]  # convolution: info, made deterministic by strict
    assert findings[0].severity == "info"


def test_backward_finding_points_at_the_forward_call(rng_changes_ok: None) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pool = nn.AdaptiveAvgPool2d(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pool(x)  # forward-line

    net = Net()
    events = _record(lambda: net(_x(1, 1, 6, 6)).sum().backward())
    (finding,) = [f for f in audit_ops(events) if f.code == "TR102"]
    line = next(
        n for n, t in enumerate(Path(__file__).read_text().splitlines(), 1) if t.endswith("# forward-line")
    )
    assert (finding.module, finding.location) == ("pool", f"tests/audit/test_audit_op_rules.py:{line}")
    assert finding.op == "aten._adaptive_avg_pool2d_backward"
    assert "recorded in backward" in finding.message and finding.severity == "error"


def test_one_finding_per_op_and_line_naming_every_module_that_ran_it(rng_changes_ok: None) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pool = nn.AdaptiveAvgPool2d(2)
            self.head = nn.AdaptiveAvgPool2d(3)
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.conv(x) + self.pool(x).mean()  # pool-line
            return x + self.head(x).mean()  # head-line

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    net = Net()
    findings = audit_ops(_record(lambda: net(_x(1, 1, 6, 6)).sum().backward()))
    lines = Path(__file__).read_text().splitlines()
    pool, head = (
        "tests/audit/test_audit_op_rules.py:" + str(next(n for n, t in enumerate(lines, 1) if t.endswith(m)))
        for m in ("# pool-line", "# head-line")
    )
    # one error per line, each naming the four blocks' modules; a second line is a second finding
    assert [(f.code, f.severity, f.location, f.module) for f in findings if f.code == "TR102"] == [
        ("TR102", "error", pool, "blocks.[0-3].pool (4 modules)"),
        ("TR102", "error", head, "blocks.[0-3].head (4 modules)"),
    ]
    (conv,) = [f for f in findings if f.code == "TR120"]  # one info per entry: the modules at its line
    assert (conv.location, conv.module) == (pool, "blocks.[0-3].conv (4 modules)")


def test_a_line_is_an_error_when_any_of_its_calls_meets_the_condition() -> None:
    unknown = {**_ev("aten.bincount.default", "t.py:4"), "module": "a"}
    weighted = {**_ev("aten.bincount.default", "t.py:4", args=["x", "w", 0]), "module": "b"}
    unweighted = {**_ev("aten.bincount.default", "t.py:4", args=["x", None, 0]), "module": "c"}
    (finding,) = audit_ops([unknown, weighted, unweighted])
    assert (finding.severity, finding.module) == ("error", "a, b (2 modules)")  # c's call is fine
    (unsure,) = audit_ops([unknown, unweighted])
    assert (unsure.severity, unsure.module) == ("warning", "a")


# --------------------------------------------------------------------------------------------
# audit_ops on given events


def _ev(op: str, location: str = "t.py:1", *, backward: bool = False, **extra: Any) -> dict[str, Any]:
    return {"op": op, "module": "m", "location": location, "backward": backward, "count": 1, **extra}


def test_one_error_per_call_site_and_one_info_per_entry() -> None:
    events = [
        _ev("aten.reflection_pad1d_backward.default", "t.py:3", backward=True),
        _ev("aten.reflection_pad1d_backward.default", "t.py:3", backward=True),
        _ev("aten.reflection_pad1d_backward.default", "t.py:9", backward=True),
        _ev("aten.convolution.default", "t.py:2"),
        _ev("aten.convolution_backward.default", "t.py:2", backward=True),
        _ev("aten.convolution.default", "t.py:5"),
    ]
    findings = audit_ops(events)
    assert [(f.code, f.severity, f.location) for f in findings] == [
        ("TR107", "error", "t.py:3"),
        ("TR107", "error", "t.py:9"),
        ("TR120", "info", "t.py:2"),
    ]
    assert "aten.convolution, aten.convolution_backward" in findings[2].message


def test_phase_and_overload_must_match() -> None:
    # the forward of reflection padding is deterministic; median without dim returns no indices
    assert audit_ops([_ev("aten.reflection_pad2d.default"), _ev("aten.median.default")]) == []
    assert [f.code for f in audit_ops([_ev("aten.median.dim")])] == ["TR114"]


@pytest.fixture
def torch_2_13_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit with torch 2.13's documented lists (cumsum raises there; torch 2.14 documents it as made
    deterministic, and a GPU run of 2.11 measured it so: measured=False leaves that out)."""
    table = load_table("2.13.0", measured=False)
    monkeypatch.setattr(op_rules, "load_table", lambda: table)


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (_ev("aten.bincount.default", args=["x", None, 0]), []),
        (_ev("aten.bincount.default", args=["x", "w", 0]), [("TR113", "error")]),
        (_ev("aten.bincount.default"), [("TR113", "warning")]),
        (_ev("aten.cumsum.default", args=[{"dtype": "torch.int64"}, 0]), []),
        (_ev("aten.cumsum.default", args=[{"dtype": "torch.float32"}, 0]), [("TR116", "error")]),
        (_ev("aten.scatter_reduce.two", args=["s", 0, "i", "prod"]), [("TR117", "error")]),
        (_ev("aten.scatter_reduce.two", args=["s", 0, "i", "sum"]), [("TR128", "info")]),
        (_ev("aten.scatter_reduce.two", args=["s", 0, "i", "amax"]), []),
        (_ev("aten.nll_loss2d_forward.default", args=["x", "t", None, 0, -100]), []),
        (_ev("aten.nll_loss2d_forward.default", args=["x", "t", None, 1, -100]), [("TR108", "error")]),
        (_ev("aten.bmm.default"), []),  # unknown sparsity: skipped, bmm is everywhere
        (_ev("aten.bmm.default", args=[{"layout": "torch.sparse_coo"}, "b"]), [("TR122", "info")]),
    ],
)
def test_conditions_use_recorded_arguments_when_there_are_some(
    event: dict[str, Any], expected: list[tuple[str, str]], torch_2_13_lists: None
) -> None:
    assert [(f.code, f.severity) for f in audit_ops([event])] == expected


def test_conditions_use_the_calls_the_probe_saw_at_the_same_line(torch_2_13_lists: None) -> None:
    events = [_ev("aten.cumsum.default", "t.py:5"), _ev("aten.bincount.default", "t.py:6")]
    calls = [
        {"fn": "cumsum", "location": "t.py:5", "floating": False},
        {"fn": "bincount", "location": "t.py:6", "weights": True},
    ]
    assert [(f.code, f.severity, f.location) for f in audit_ops(events, calls=calls)] == [
        ("TR113", "error", "t.py:6")
    ]
    # two calls on one line, one floating: the op may be the floating one
    calls.append({"fn": "cumsum", "location": "t.py:5", "floating": True})
    assert [f.code for f in audit_ops(events, calls=calls) if f.severity == "error"] == ["TR113", "TR116"]
    # facts from another line decide nothing
    (finding,) = audit_ops([_ev("aten.cumsum.default", "t.py:9")], calls=calls)
    assert finding.severity == "warning" and "cannot tell" in finding.message


def test_events_may_be_opevent_objects_and_bad_events_are_named() -> None:
    from torchrepro.tracing import OpEvent

    event = OpEvent("aten.histc.default", "net.h", "t.py:4", False, 2)
    (finding,) = audit_ops([event])
    assert (finding.code, finding.module, finding.op) == ("TR112", "net.h", "aten.histc")
    with pytest.raises(TraceError, match="'op'"):
        audit_ops([{"module": "x"}])


def test_finding_round_trip_and_validation() -> None:
    f = Finding("TR112", "error", "aten.histc", "net.h", "t.py:4", "msg", "fix")
    assert Finding.from_dict(json.loads(json.dumps(f.to_dict()))) == f
    assert list(f.to_dict()) == ["code", "severity", "op", "module", "location", "message", "fix"]
    with pytest.raises(ValueError, match="severity"):
        Finding("TR1", "fatal", None, None, None, "m", "f")
    report = AuditReport((f,), "s.py", 1, 1, 10, torch.__version__, "2.13", None)
    assert report.errors == (f,)
    assert json.loads(json.dumps(report.to_dict()))["findings"] == [f.to_dict()]


# --------------------------------------------------------------------------------------------
# The fixes the audit suggests remove the errors (examples/audit_example.py)


@pytest.mark.parametrize("fixed", [False, True])
def test_suggested_fixes_remove_the_errors(fixed: bool, rng_changes_ok: None) -> None:
    import importlib.util

    path = Path(__file__).parents[2] / "examples" / "audit_example.py"
    spec = importlib.util.spec_from_file_location("audit_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.SegNet(fixed=fixed)
    events = _record(lambda: model(torch.randn(2, 3, 16, 16)).sum().backward())
    errors = sorted(f.code for f in audit_ops(events) if f.severity == "error")
    assert errors == ([] if fixed else ["TR102"])
    # bilinear upsampling and reflection padding: strict mode computes their backward
    # deterministically (measured on a GPU), so they are info, not errors
    infos = {f.code for f in audit_ops(events) if f.severity == "info"}
    assert {"TR106", "TR107"} <= infos if not fixed else not {"TR106", "TR107"} & infos


@pytest.mark.parametrize(
    ("release", "event", "expected", "source"),
    [
        # documented as raising, measured deterministic under strict mode from 2.11 on
        (
            "2.13",
            _ev("aten.cumsum.default", args=[{"dtype": "torch.float32"}, 0]),
            ("TR116", "info"),
            "measured",
        ),
        ("2.4", _ev("aten.cumsum.default", args=[{"dtype": "torch.float32"}, 0]), ("TR116", "error"), "copy"),
        ("2.13", _ev("aten.reflection_pad2d_backward.default", backward=True), ("TR107", "info"), "measured"),
        ("2.13", _ev("aten.reflection_pad1d_backward.default", backward=True), ("TR107", "error"), "copy"),
        # not documented, measured raising
        ("2.13", _ev("aten.nanmedian.dim"), ("TR134", "error"), "measured"),
        ("2.4", _ev("aten.nanmedian.dim"), ("TR134", "info"), None),
        # strict mode does not stop cuDNN's grid sampler: an error that says so
        (
            "2.13",
            _ev("aten.cudnn_grid_sampler_backward.default", backward=True),
            ("TR115", "error"),
            "measured",
        ),
    ],
)
def test_what_a_gpu_measured_overrides_the_documentation_from_its_release_on(
    release: str,
    event: dict[str, Any],
    expected: tuple[str, str],
    source: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = load_table(f"{release}.0")
    monkeypatch.setattr(op_rules, "load_table", lambda: table)
    (finding,) = audit_ops([event])
    assert (finding.code, finding.severity) == expected
    if source == "measured":
        assert "(measured on an NVIDIA H200, torch 2.11.0+cu130" in finding.message
    elif source == "copy":
        assert f"(torchrepro's copy of the torch {release} documentation)" in finding.message
    if expected[0] == "TR115":
        assert "does not stop aten.cudnn_grid_sampler_backward" in finding.message
        assert "align_corners=False" in finding.fix
    # without the measurements the documentation's section is back
    monkeypatch.setattr(op_rules, "load_table", lambda: load_table(f"{release}.0", measured=False))
    documented = [(f.code, f.severity) for f in audit_ops([event])]
    if source == "measured" and expected[0] != "TR134":
        assert documented == [(expected[0], "error")]
