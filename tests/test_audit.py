"""audit in-process: the op table against torch's documentation, op and settings analysis.

The op examples run real torch ops on the CPU under the real ``OpRecorder``: each entry of the table
must be found from the ops a CPU run records (that is the point of the audit), and a plain CNN
must give no error (negative control).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchrepro._child.hooks import _probe_dataset, _random_hint, _sampler_facts
from torchrepro.audit import AuditReport, Finding, audit_ops, audit_settings, rules
from torchrepro.audit.optable import _GENERIC_FIX, _TABLE_FILE, _documented_items, _load_table, _release_of
from torchrepro.errors import TraceError
from torchrepro.tracing import OpRecorder

# --------------------------------------------------------------------------------------------
# The op lists come from the installed torch's documentation; the hints are data, keyed by op


def _copies() -> dict[str, dict[str, str]]:
    """torchrepro's copy of each release's documented items: release -> item -> section."""
    data = json.loads(_TABLE_FILE.read_text())["documentation"]
    return {r: {i: s for s in ("raises", "deterministic") for i in data[r][s]} for r in data}


def _hintless(table: Any) -> list[str]:
    """Documented items with no entry, or whose entry has no hint for the section they are in there."""
    missing = [f"no entry: {item}" for item in table.uncovered]
    for e in table.entries:
        if e.fix == _GENERIC_FIX.get(e.section):
            missing += [f"no {e.section} hint in {e.code}: {item}" for item in e.doc]
    return sorted(missing)


def test_every_item_the_installed_torch_documents_has_ops_and_a_hint() -> None:
    documented = _documented_items()
    assert len(documented) >= 40, "the parser found too few items: did the documentation's layout change?"
    table = _load_table()
    assert table.read and table.exact and table.listed_in == f"torch {table.release} documentation"
    assert _hintless(table) == [], f"torch {torch.__version__} documents ops the table has no hint for"


def test_every_item_of_every_copy_has_ops_and_a_hint_and_every_entry_item_is_documented() -> None:
    copies = _copies()
    for release in copies:
        table = _load_table(f"{release}.0")
        assert (table.release, table.read) == (release, False)
        assert _hintless(table) == [], f"torch {release} (copy) documents ops the table has no hint for"
    ever = {item for documented in copies.values() for item in documented} | set(_documented_items())
    raw = json.loads(_TABLE_FILE.read_text())["entries"]
    stale = sorted(d for e in raw for d in e.get("doc", ()) if d not in ever)
    assert stale == [], f"in the table but documented by no release: {stale}"
    for e in raw:
        for o in e["ops"]:
            assert set(o.get("doc", ())) <= set(e.get("doc", ())), (e["code"], o["op"])


def test_the_copy_of_the_installed_release_equals_its_documentation() -> None:
    release = ".".join(torch.__version__.split(".")[:2])
    copies = _copies()
    if release not in copies:
        pytest.skip(f"torchrepro keeps no copy of torch {release}'s documentation")
    assert copies[release] == _documented_items()


def test_table_entries_are_well_formed_and_name_real_aten_ops() -> None:
    table = _load_table()
    keys = [(e.code, e.section) for e in table.entries]
    assert len(keys) == len(set(keys))
    for entry in table.entries:
        assert entry.section in ("raises", "deterministic", "extra")
        assert (entry.section == "extra") == (not entry.doc), entry.code
        assert entry.fix and entry.title and entry.ops
        for spec in entry.ops:
            assert spec.phase in ("forward", "backward", "any")
            ns, name = spec.name.split(".")
            assert ns == "aten"
            if entry.section == "extra" and not hasattr(torch.ops.aten, name):
                continue  # an extra entry may name kernels of newer releases (SDPA variants)
            packet = getattr(torch.ops.aten, name)  # raises if torch has no such op
            if spec.overload is not None:
                assert spec.overload in packet.overloads(), (
                    f"{entry.code}: no overload {spec.overload} of {name}"
                )
    for name in table.cublas_ops:
        getattr(torch.ops.aten, name.split(".")[1])
    raw = json.loads(_TABLE_FILE.read_text())
    assert raw["schema"] == 2 and all(r.count(".") == 1 for r in raw["documentation"])
    for e in raw["entries"]:
        assert set(e["fix"]) <= {"raises", "deterministic", "extra"}, e["code"]
        assert ("extra" in e["fix"]) == (not e.get("doc")), e["code"]


def test_doc_parser_reads_multiline_items_and_sub_bullets() -> None:
    doc = """Intro.

    The following normally-nondeterministic operations will act
    deterministically when ``mode=True``:

        * :class:`torch.nn.Conv1d` when called on CUDA tensor
        * :func:`torch.Tensor.__getitem__` when attempting to differentiate a CPU tensor
          and the index is a list of tensors

    The following normally-nondeterministic operations will throw a
    :class:`RuntimeError` when ``mode=True``:

        * :func:`torch.nn.functional.interpolate` when attempting to differentiate a CUDA tensor
          and one of the following modes is used:

          - ``linear``
          - ``bilinear``

        * :func:`torch.histc` when called on a CUDA tensor

    In addition, several operations fill uninitialized memory.
    """
    assert _documented_items(doc) == {
        ":class:`torch.nn.Conv1d` when called on CUDA tensor": "deterministic",
        ":func:`torch.Tensor.__getitem__` when attempting to differentiate a CPU tensor and the index is a "
        "list of tensors": "deterministic",
        ":func:`torch.nn.functional.interpolate` when attempting to differentiate a CUDA tensor and one of "
        "the following modes is used: - ``linear`` - ``bilinear``": "raises",
        ":func:`torch.histc` when called on a CUDA tensor": "raises",
    }


def _newest_copy() -> str:
    return max(json.loads(_TABLE_FILE.read_text())["documentation"], key=_release_of)


def test_table_for_an_unknown_release_falls_back_to_the_newest_copy_at_or_below_it() -> None:
    newest = _newest_copy()
    table = _load_table("99.1.0")
    assert (table.release, table.exact, table.read) == (newest, False, False)
    assert table.listed_in == f"torchrepro's copy of the torch {newest} documentation"
    assert _load_table("2.13.5").release == "2.13" and _load_table("2.13.5").exact
    assert _load_table("2.12.0").release == "2.4" and not _load_table("2.12.0").exact
    assert _load_table("1.13.0").release == "2.4"  # below every copy: the oldest


def test_an_unreadable_documentation_falls_back_to_the_copy_and_the_audit_says_so(
    monkeypatch: pytest.MonkeyPatch, rng_changes_ok: None
) -> None:
    table = _load_table(doc="Sets whether PyTorch operations must use deterministic algorithms.")
    want = _release_of(torch.__version__)
    assert not table.read and _release_of(table.release) <= want
    assert all(e.listed_in == table.listed_in for e in table.entries if e.section != "extra")
    monkeypatch.setattr(rules, "_load_table", lambda: table)
    (tr001,) = [f for f in rules._table_findings() if f.code == "TR001"]
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


EXAMPLES: dict[str, Callable[[], object]] = {
    "TR101": lambda: nn.AvgPool3d(2)(_x(1, 1, 4, 4, 4)).sum().backward(),
    "TR102": lambda: nn.AdaptiveAvgPool2d(3)(_x(1, 2, 6, 6)).sum().backward(),
    "TR103": lambda: nn.AdaptiveMaxPool2d(3)(_x(1, 2, 6, 6)).sum().backward(),
    "TR104": lambda: nn.FractionalMaxPool2d(2, output_size=3)(_x(1, 2, 6, 6)).sum().backward(),
    "TR105": _unpool,
    "TR106": lambda: F.interpolate(_x(1, 1, 4, 4), scale_factor=2, mode="bicubic").sum().backward(),
    "TR107": lambda: F.pad(_x(1, 1, 4, 4), (1, 1, 1, 1), mode="reflect").sum().backward(),
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
}
NEEDS_ARGUMENTS = {
    # Reported only when the recording carries the call's arguments (the OpRecorder does not):
    "TR118": "resize_ matters only on quantized tensors",
    "TR122": "bmm matters only with a sparse input",
    "TR128": "scatter_reduce sum/mean vs amax/amin needs the reduce argument",
}


def _record(fn: Callable[[], object]) -> list[Any]:
    with OpRecorder() as rec:
        fn()
    return rec.events


def test_every_entry_has_an_example_or_a_reason() -> None:
    codes = {e["code"] for e in json.loads(_TABLE_FILE.read_text())["entries"]}
    assert set(EXAMPLES) | set(NEEDS_ARGUMENTS) == codes
    assert not set(EXAMPLES) & set(NEEDS_ARGUMENTS)


_SEVERITIES = {"raises": {"error", "warning"}, "deterministic": {"info"}, "extra": {"info"}}


@pytest.mark.parametrize("code", sorted(EXAMPLES))
def test_entry_is_found_from_a_cpu_run_when_this_torch_documents_it(code: str, rng_changes_ok: None) -> None:
    torch.manual_seed(0)
    table = _load_table()
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
            assert f"({table.listed_in})" in f.message, f.message
    location = findings[0].location or ""
    assert location.startswith("tests/test_audit.py:"), location


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
    table = _load_table(f"{release}.0")  # torchrepro's copy of that release's documentation
    monkeypatch.setattr(rules, "_load_table", lambda: table)
    run = EXAMPLES.get(example) or (lambda: nn.ReplicationPad1d(1)(_x(1, 1, 4)).sum().backward())
    findings = [f for f in audit_ops(_record(run)) if f.code == code]
    assert {f.severity for f in findings} == severities
    assert all(f"(torchrepro's copy of the torch {release} documentation)" in f.message for f in findings)


def test_a_raising_op_says_where_its_documentation_says_it_raises(rng_changes_ok: None) -> None:
    events = [e for code in ("TR101", "TR105", "TR111") for e in _record(EXAMPLES[code])]
    message = {f.code: f.message for f in audit_ops(events)}
    source = f"({_load_table().listed_in})"
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
    assert (finding.module, finding.location) == ("pool", f"tests/test_audit.py:{line}")
    assert finding.op == "aten._adaptive_avg_pool2d_backward"
    assert "recorded in backward" in finding.message and finding.severity == "error"


# --------------------------------------------------------------------------------------------
# audit_ops on given events


def _ev(op: str, location: str = "t.py:1", *, backward: bool = False, **extra: Any) -> dict[str, Any]:
    return {"op": op, "module": "m", "location": location, "backward": backward, "count": 1, **extra}


def test_one_error_per_call_site_and_one_info_per_entry() -> None:
    events = [
        _ev("aten.reflection_pad2d_backward.default", "t.py:3", backward=True),
        _ev("aten.reflection_pad2d_backward.default", "t.py:3", backward=True),
        _ev("aten.reflection_pad2d_backward.default", "t.py:9", backward=True),
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
    """Audit with torch 2.13's lists (cumsum raises there; torch 2.14 made it deterministic)."""
    table = _load_table("2.13.0")
    monkeypatch.setattr(rules, "_load_table", lambda: table)


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
    report = AuditReport((f,), "s.py", 1, 1, 10, torch.__version__, "2.13", {})
    assert report.errors == (f,)
    assert json.loads(json.dumps(report.to_dict()))["findings"] == [f.to_dict()]


# --------------------------------------------------------------------------------------------
# audit_settings


CONV = [_ev("aten.convolution.default")]
MM = [_ev("aten.addmm.default")]


@pytest.mark.parametrize(
    ("settings", "events", "expected"),
    [
        ({"hash_randomization": True}, [], [("TR201", "warning")]),
        ({"hash_randomization": False}, [], []),
        ({"cublas_workspace_config": None}, MM, [("TR202", "warning")]),
        ({"cublas_workspace_config": None}, [], []),
        ({"cublas_workspace_config": ":4096:8"}, MM, []),
        (
            {"cublas_workspace_config": None, "deterministic_algorithms": True, "warn_only": False},
            MM,
            [("TR202", "error")],
        ),
        ({"cudnn_benchmark": True}, [], [("TR203", "warning")]),
        ({"matmul_allow_tf32": True, "float32_matmul_precision": "high"}, [], [("TR204", "info")]),
        ({"cudnn_allow_tf32": True}, [], []),
        ({"cudnn_allow_tf32": True}, CONV, [("TR204", "info")]),
        ({"deterministic_algorithms": False}, CONV, [("TR205", "warning")]),
        ({"deterministic_algorithms": False, "cudnn_deterministic": True}, CONV, []),
        ({"deterministic_algorithms": False}, MM, []),
        ({"deterministic_algorithms": True, "warn_only": True}, [], [("TR206", "warning")]),
        ({"set_num_threads_called": False, "thread_env": {}, "num_threads": 8}, [], [("TR207", "warning")]),
        ({"set_num_threads_called": False, "thread_env": {"OMP_NUM_THREADS": "4"}}, [], []),
        ({"torch_seeded": False}, [], [("TR208", "warning")]),
        ({"torch_seeded": True}, [], []),
        ({"dataloaders": [{"num_workers": 2, "random_hint": "RandomCrop"}]}, [], [("TR301", "warning")]),
        ({"dataloaders": [{"num_workers": 2, "random_hint": "x", "seeded_loader": True}]}, [], []),
        ({"dataloaders": [{"num_workers": 2}]}, [], [("TR302", "info")]),
        ({"dataloaders": [{"num_workers": 0, "shuffle": True, "generator": False}]}, [], [("TR303", "info")]),
        ({"dataloaders": [{"num_workers": 0, "shuffle": True, "generator": True}]}, [], []),
        (
            {"compile_calls": [{"backend": "inductor"}], "deterministic_algorithms": False},
            [],
            [("TR401", "warning")],
        ),
        ({"compile_calls": [{"backend": "inductor"}], "inductor_deterministic": True}, [], []),
        ({"compile_calls": [{"backend": "eager"}]}, [], []),
        ({"optimizer_steps": 0}, [], [("TR003", "info")]),
        ({}, CONV + MM, []),
    ],
)
def test_settings_findings(
    settings: dict[str, Any], events: list[dict[str, Any]], expected: list[tuple[str, str]]
) -> None:
    assert [(f.code, f.severity) for f in audit_settings(settings, events=events)] == expected


def test_warn_only_finding_names_the_ops_that_stay_nondeterministic() -> None:
    events = [_ev("aten.upsample_bilinear2d_backward.default", backward=True)]
    (finding,) = audit_settings({"deterministic_algorithms": True, "warn_only": True}, events=events)
    assert "aten.upsample_bilinear2d_backward" in finding.message


# --------------------------------------------------------------------------------------------
# The DataLoader random-augmentation hint


class RandomCropLike:
    def __call__(self, x: object) -> object:
        return x


class Compose:
    def __init__(self, transforms: list[object]) -> None:
        self.transforms = transforms


class WithTransform(torch.utils.data.Dataset[int]):
    transform = Compose([RandomCropLike()])

    def __getitem__(self, i: int) -> int:
        return i


class DrawsNumpy(torch.utils.data.Dataset[float]):
    def __getitem__(self, i: int) -> float:
        import numpy as np

        return float(np.random.uniform())


class Plain(torch.utils.data.Dataset[int]):
    def __getitem__(self, i: int) -> int:
        return i * 2


def test_random_hint() -> None:
    assert _random_hint(WithTransform()) == "transforms RandomCropLike"
    assert _random_hint(DrawsNumpy()) == "DrawsNumpy.__getitem__ calls np.random."
    assert _random_hint(Plain()) is None
    assert _random_hint(torch.utils.data.Subset(WithTransform(), [0])) == "transforms RandomCropLike"


# --------------------------------------------------------------------------------------------
# The per-dataset probe: which global RNG does __getitem__ draw from, found by loading index 0


class _Sized(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return 4


class DrawsRandom(_Sized):
    def __getitem__(self, i: int) -> float:
        import random

        return i + random.random()


class DrawsNumpyGlobal(_Sized):
    def __getitem__(self, i: int) -> Any:
        import numpy as np

        return {"x": np.arange(3.0) + np.random.uniform(), "y": i}


class DrawsTorch(_Sized):
    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(3)


class FakeDataLike(_Sized):
    """torchvision's FakeData: seeds torch per index and restores the state; its source calls
    torch.randn, so the name/source heuristic takes it for random augmentation."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        state = torch.get_rng_state()
        torch.manual_seed(i + 7)
        x = torch.randn(3)
        torch.set_rng_state(state)
        return x, i


class OwnUnseededGenerator(_Sized):
    def __getitem__(self, i: int) -> float:
        import numpy as np

        return float(np.random.default_rng().uniform())


class Doubles(_Sized):
    def __getitem__(self, i: int) -> int:
        return i * 2


class Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


class Broken(_Sized):
    def __getitem__(self, i: int) -> int:
        raise KeyError(i)


@pytest.mark.parametrize(
    ("dataset", "expected"),
    [
        (DrawsRandom(), {"ran": True, "draws": ["random"], "unstable": False}),
        (DrawsNumpyGlobal(), {"ran": True, "draws": ["numpy"], "unstable": False}),
        (DrawsTorch(), {"ran": True, "draws": ["torch"], "unstable": False}),
        (FakeDataLike(), {"ran": True, "draws": [], "unstable": False}),
        (Doubles(), {"ran": True, "draws": [], "unstable": False}),
        (OwnUnseededGenerator(), {"ran": True, "draws": [], "unstable": True}),
        (Stream(), {"ran": False, "reason": "an IterableDataset has no index to load twice"}),
        (Broken(), {"ran": False, "reason": "loading index 0 raised KeyError"}),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, torch.utils.data.Dataset) else "",
)
def test_probe_finds_the_global_rng_a_dataset_draws_from(dataset: Any, expected: dict[str, Any]) -> None:
    # the autouse fixture asserts the probe left every global RNG state as it found it
    assert _probe_dataset(dataset) == expected


def test_probe_is_not_fooled_by_what_the_source_says() -> None:
    # negative control: the source heuristic flags the self-seeding dataset, the probe does not
    assert _random_hint(FakeDataLike()) == "FakeDataLike.__getitem__ calls torch.randn"
    assert _probe_dataset(FakeDataLike())["draws"] == []
    # nor by the class name: a self-seeding class named like one that draws is still clean
    namesake = type("DrawsRandom", (FakeDataLike,), {})
    assert _probe_dataset(namesake())["draws"] == [] and _probe_dataset(DrawsRandom())["draws"] == ["random"]


def test_probe_leaves_the_scripts_draws_alone(rng_changes_ok: None) -> None:
    import random

    random.seed(3)
    torch.manual_seed(3)
    expected = (random.random(), torch.rand(2))
    random.seed(3)
    torch.manual_seed(3)
    _probe_dataset(DrawsRandom())
    _probe_dataset(DrawsTorch())
    got = (random.random(), torch.rand(2))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])


_SEEDED = {"random": True, "numpy": True, "torch": True}
_UNSEEDED = {"random": False, "numpy": False, "torch": False}


def _loader(**kw: Any) -> dict[str, Any]:
    return {"dataset": "Aug", "location": "train.py:9", "num_workers": 0, **kw}


def _draws(*rngs: str) -> dict[str, Any]:
    return {"ran": True, "draws": list(rngs), "unstable": False}


@pytest.mark.parametrize(
    ("loader", "seeded", "expected"),
    [
        # main-process loading: every global RNG the dataset draws from must be seeded by the script
        (_loader(probe=_draws("random")), {**_SEEDED, "random": False}, ["TR304"]),
        (_loader(probe=_draws("numpy")), {**_SEEDED, "random": False}, []),
        (_loader(probe=_draws("numpy")), _SEEDED, []),
        # in workers torch reseeds all three from the base seed: only torch's seeding (or generator=) counts
        (_loader(num_workers=2, probe=_draws("numpy")), {**_UNSEEDED, "torch": True}, ["TR301"]),
        (_loader(num_workers=2, probe=_draws("numpy")), _UNSEEDED, ["TR301", "TR304"]),
        (_loader(num_workers=2, probe=_draws("numpy"), generator=True), _UNSEEDED, ["TR301"]),
        # measured to draw nothing: no "might draw" info either
        (_loader(num_workers=2, probe=_draws(), random_hint="RandomCrop"), _UNSEEDED, []),
        # the probe could not run: the heuristic decides
        (_loader(num_workers=2, probe={"ran": False}, random_hint="RandomCrop"), _UNSEEDED, ["TR301"]),
        (_loader(probe={"ran": True, "draws": [], "unstable": True}), _SEEDED, ["TR306"]),
    ],
)
def test_dataset_findings(loader: dict[str, Any], seeded: dict[str, bool], expected: list[str]) -> None:
    findings = audit_settings({"dataloaders": [loader], "seeded": seeded})
    assert sorted(f.code for f in findings) == expected
    assert all(f.location == "train.py:9" for f in findings)


def test_dataset_finding_names_the_rng_and_the_framework_setting() -> None:
    loader = _loader(probe=_draws("random", "numpy"), framework="lightning")
    (finding,) = audit_settings({"dataloaders": [loader], "seeded": {**_SEEDED, "numpy": False}})
    assert "Aug.__getitem__" in finding.message and "NumPy's global RNG" in finding.message
    assert "Python's global random" not in finding.message  # seeded: not named
    assert "np.random.seed(0)" in finding.fix and "seed_everything(0, workers=True)" in finding.fix
    (hf,) = audit_settings({"dataloaders": [{**loader, "framework": "transformers"}], "seeded": _UNSEEDED})
    assert "TrainingArguments(seed=" in hf.fix


@pytest.mark.parametrize(
    ("loader", "fix"),
    [
        ({"shuffle": True, "generator": False}, "Pass generator="),
        (
            {"shuffle": True, "generator": True, "sampler_generator": False, "sampler_given": "sampler"},
            "Give the generator to the sampler: RandomSampler(dataset, generator=",
        ),
        (
            {"shuffle": True, "sampler_generator": False, "sampler_given": "batch_sampler"},
            "Give the generator to the sampler",
        ),
        ({"shuffle": True, "generator": False, "sampler_generator": True, "sampler_given": "sampler"}, None),
    ],
)
def test_shuffle_fix_names_the_generator_that_draws_the_order(
    loader: dict[str, Any], fix: str | None
) -> None:
    findings = audit_settings({"dataloaders": [{"num_workers": 0, "sampler": "RandomSampler", **loader}]})
    assert [f.fix.startswith(fix) for f in findings] == ([] if fix is None else [True])
    if loader.get("generator") and loader.get("sampler_given"):
        assert "does not reach it" in findings[0].message


def test_sampler_facts_name_the_sampler_that_draws_the_order() -> None:
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    data = Doubles()
    seeded = torch.Generator().manual_seed(0)
    cases = [
        (DataLoader(data, shuffle=True), None, ("RandomSampler", False)),
        (DataLoader(data, shuffle=True, generator=seeded), None, ("RandomSampler", True)),
        (
            DataLoader(data, sampler=RandomSampler(data), generator=seeded),
            "sampler",
            ("RandomSampler", False),
        ),
        (
            DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data, generator=seeded), 2, False)),
            "batch_sampler",
            ("RandomSampler", True),
        ),
        (DataLoader(data), None, ("SequentialSampler", False)),
    ]
    for loader, given, (sampler, has_generator) in cases:
        facts = _sampler_facts(loader, given)
        assert (facts["sampler"], facts["sampler_generator"]) == (sampler, has_generator)
        assert facts["shuffle"] == (sampler == "RandomSampler")


def test_probe_tells_seeds_drawn_from_unseeded_sources(tmp_path: Path) -> None:
    import time

    from torchrepro._child.hooks import SettingsProbe

    probe = SettingsProbe(str(tmp_path / "probe.json"))  # not installed: nothing is patched
    probe._drawn[1_234_567] = "random.randint"
    probe._on_seed("torch", "torch.manual_seed", 1_234_567)
    probe._on_seed("numpy", "np.random.seed", int(time.time() * 1000))
    probe._on_seed("random", "random.seed", None)
    assert [(c["call"], c["source"]) for c in probe.tainted_seeds] == [
        ("torch.manual_seed", "random.randint"),
        ("np.random.seed", "the current time"),
        ("random.seed", "OS entropy (called without a seed)"),
    ]
    assert probe.seeded == {"torch": False, "numpy": False, "random": False}
    # constants no unseeded source returned are clean, and the last seeding decides
    for value in (0, 1_234_568, 2**31 - 1):
        probe._on_seed("torch", "torch.manual_seed", value)
        assert probe.seeded["torch"] is True
    assert len(probe.tainted_seeds) == 3


def test_seed_drawn_from_an_unseeded_source() -> None:
    call = {"call": "torch.manual_seed", "rng": "torch", "location": "train.py:3", "source": "random.randint"}
    (finding,) = audit_settings({"tainted_seeds": [call]})
    assert (finding.code, finding.severity, finding.location) == ("TR305", "warning", "train.py:3")
    assert "random.randint" in finding.message and "torch's global RNG" in finding.message


# --------------------------------------------------------------------------------------------
# The fixes the audit suggests remove the errors (examples/audit_example.py)


@pytest.mark.parametrize("fixed", [False, True])
def test_suggested_fixes_remove_the_errors(fixed: bool, rng_changes_ok: None) -> None:
    import importlib.util

    path = Path(__file__).parents[1] / "examples" / "audit_example.py"
    spec = importlib.util.spec_from_file_location("audit_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.SegNet(fixed=fixed)
    events = _record(lambda: model(torch.randn(2, 3, 16, 16)).sum().backward())
    errors = sorted(f.code for f in audit_ops(events) if f.severity == "error")
    assert errors == ([] if fixed else ["TR102", "TR106", "TR107"])
