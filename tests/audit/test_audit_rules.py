"""audit in-process: the op table against torch's documentation, op and settings analysis.

The op examples run real torch ops on the CPU under the real ``OpRecorder``: each entry of the table
must be found from the ops a CPU run records (that is the point of the audit), and a plain CNN
must give no error (negative control).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchrepro.audit import AuditReport, Finding, ProbeSettings, audit_ops, audit_settings
from torchrepro.audit.rules import _TABLE_FILE, _documented_items, _load_table
from torchrepro.errors import TraceError
from torchrepro.flags import CUBLAS_CONFIGS
from torchrepro.tracing import OpRecorder

# --------------------------------------------------------------------------------------------
# The table is data, kept equal to the installed torch's documentation


def test_table_covers_exactly_the_documented_items_of_the_installed_torch() -> None:
    documented = _documented_items()
    assert len(documented) >= 40, "the parser found too few items: did the documentation's layout change?"
    table = _load_table()
    assert table.exact, f"no table for torch {torch.__version__}: add a release to {_TABLE_FILE.name}"
    covered: dict[str, str] = {}
    for entry in table.entries:
        for item in entry.doc:
            assert item not in covered, f"{item!r} is covered twice ({covered.get(item)} and {entry.code})"
            covered[item] = entry.code
            # an entry that raises may also cover the same op's made-deterministic item (put_ on CPU)
            allowed = {"raises", "deterministic"} if entry.section == "raises" else {entry.section}
            assert documented.get(item) in allowed, f"{entry.code}: {item!r} is not a {entry.section} item"
    missing = sorted(set(documented) - set(covered))
    stale = sorted(set(covered) - set(documented))
    assert missing == [], f"documented by torch {torch.__version__} but not in the table: {missing}"
    assert stale == [], f"in the table but no longer documented by torch {torch.__version__}: {stale}"


def test_table_entries_are_well_formed_and_name_real_aten_ops() -> None:
    table = _load_table()
    codes = [e.code for e in table.entries]
    assert len(codes) == len(set(codes))
    for entry in table.entries:
        assert entry.section in ("raises", "deterministic", "extra")
        assert (entry.section == "extra") == (not entry.doc), entry.code
        assert entry.fix and entry.title and entry.ops
        for spec in entry.ops:
            assert spec.phase in ("forward", "backward", "any")
            ns, name = spec.name.split(".")
            assert ns == "aten"
            packet = getattr(torch.ops.aten, name)  # raises if torch has no such op
            if spec.overload is not None:
                assert spec.overload in packet.overloads(), (
                    f"{entry.code}: no overload {spec.overload} of {name}"
                )
    for name in table.cublas_ops:
        getattr(torch.ops.aten, name.split(".")[1])
    raw = json.loads(_TABLE_FILE.read_text())
    assert set(raw["releases"]) and all(r.count(".") == 1 for r in raw["releases"])


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


def test_table_for_an_unknown_release_falls_back_to_the_newest_older_one() -> None:
    newest = max(json.loads(_TABLE_FILE.read_text())["releases"], key=lambda r: tuple(map(int, r.split("."))))
    table = _load_table("99.1.0")
    assert (table.release, table.exact) == (newest, False)


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
    "TR120": lambda: nn.Conv2d(1, 1, 3)(_x(1, 1, 5, 5)).sum().backward(),
    "TR121": lambda: nn.ReplicationPad2d(1)(_x(1, 1, 4, 4)).sum().backward(),
    "TR123": lambda: _x(5)[(torch.tensor([0, 0, 2]),)].sum().backward(),
    "TR124": lambda: _x(5).gather(0, torch.tensor([1, 1])).sum().backward(),
    "TR125": lambda: _x(5).index_select(0, torch.tensor([1, 1])).sum().backward(),
    "TR126": lambda: torch.zeros(5).index_copy_(0, torch.tensor([1, 3]), torch.ones(2)),
    "TR127": lambda: torch.zeros(5).scatter_(0, torch.tensor([1, 1]), torch.ones(2)),
    "TR129": lambda: nn.MaxPool3d(2)(_x(1, 1, 4, 4, 4)).sum().backward(),
    "TR130": _sdpa,
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
    codes = {e.code for e in _load_table().entries}
    assert set(EXAMPLES) | set(NEEDS_ARGUMENTS) == codes
    assert not set(EXAMPLES) & set(NEEDS_ARGUMENTS)


@pytest.mark.parametrize("code", sorted(EXAMPLES))
def test_entry_is_found_from_a_cpu_run(code: str, rng_changes_ok: None) -> None:
    torch.manual_seed(0)
    findings = [f for f in audit_ops(_record(EXAMPLES[code])) if f.code == code]
    assert findings, f"{code}: no finding from the ops of its example"
    entry = next(e for e in _load_table().entries if e.code == code)
    want = {"raises": {"error", "warning"}, "deterministic": {"info"}, "extra": {"info"}}[entry.section]
    assert {f.severity for f in findings} <= want
    if entry.condition is not None and entry.section == "raises":
        # the recorder gives no arguments: the finding says what it cannot tell, and is no error
        assert all(f.severity == "warning" and "cannot tell" in f.message for f in findings)
    elif entry.section == "raises":
        assert all(f.severity == "error" for f in findings)
    location = findings[0].location or ""
    assert location.startswith("tests/audit/test_audit_rules.py:"), location


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
    assert (finding.module, finding.location) == ("pool", f"tests/audit/test_audit_rules.py:{line}")
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
    event: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    assert [(f.code, f.severity) for f in audit_ops([event])] == expected


def test_conditions_use_the_calls_the_probe_saw_at_the_same_line() -> None:
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
# audit_settings


def _settings(**changes: Any) -> ProbeSettings:
    """Settings with which a script is reproducible and nothing is reported, changed as given."""
    base = ProbeSettings(
        hash_randomization=False,
        pythonhashseed="0",
        cublas_workspace_config=CUBLAS_CONFIGS[0],
        deterministic_algorithms=True,
        warn_only=False,
        cudnn_benchmark=False,
        cudnn_deterministic=True,
        cudnn_allow_tf32=False,
        cuda_matmul_allow_tf32=False,
        float32_matmul_precision="highest",
        num_threads=1,
        set_num_threads_called=True,
        thread_env={"OMP_NUM_THREADS": None, "MKL_NUM_THREADS": None},
        torch_seeded=True,
        seeded={"random": True, "numpy": True, "torch": True},
        tainted_seeds=(),
        inductor_deterministic=None,
        compile_calls=(),
        dataloaders=(),
        optimizer_steps=1,
        calls=(),
        cuda_initialized=False,
    )
    records = {k: tuple(v) for k, v in changes.items() if isinstance(v, list)}
    return dataclasses.replace(base, **{**changes, **records})


def test_reproducible_settings_give_no_finding() -> None:
    assert audit_settings(_settings(), events=CONV + MM) == []


CONV = [_ev("aten.convolution.default")]
MM = [_ev("aten.addmm.default")]


@pytest.mark.parametrize(
    ("settings", "events", "expected"),
    [
        ({"hash_randomization": True}, [], [("TR201", "warning")]),
        ({"hash_randomization": False}, [], []),
        ({"cublas_workspace_config": None, "deterministic_algorithms": False}, MM, [("TR202", "warning")]),
        ({"cublas_workspace_config": None}, [], []),
        ({"cublas_workspace_config": ":4096:8"}, MM, []),
        (
            {"cublas_workspace_config": None, "deterministic_algorithms": True, "warn_only": False},
            MM,
            [("TR202", "error")],
        ),
        ({"cudnn_benchmark": True}, [], [("TR203", "warning")]),
        ({"cuda_matmul_allow_tf32": True, "float32_matmul_precision": "high"}, [], [("TR204", "info")]),
        ({"cudnn_allow_tf32": True}, [], []),
        ({"cudnn_allow_tf32": True}, CONV, [("TR204", "info")]),
        ({"deterministic_algorithms": False, "cudnn_deterministic": False}, CONV, [("TR205", "warning")]),
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
    # every other setting as in _settings(): reproducible, nothing to report
    found = audit_settings(_settings(**settings), events=events)
    assert [(f.code, f.severity) for f in found] == expected


def test_warn_only_finding_names_the_ops_that_stay_nondeterministic() -> None:
    events = [_ev("aten.upsample_bilinear2d_backward.default", backward=True)]
    (finding,) = audit_settings(_settings(warn_only=True), events=events)
    assert "aten.upsample_bilinear2d_backward" in finding.message


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
    findings = audit_settings(_settings(dataloaders=[loader], seeded=seeded))
    assert sorted(f.code for f in findings) == expected
    assert all(f.location == "train.py:9" for f in findings)


def test_dataset_finding_names_the_rng_and_the_framework_setting() -> None:
    loader = _loader(probe=_draws("random", "numpy"), framework="lightning")
    (finding,) = audit_settings(_settings(dataloaders=[loader], seeded={**_SEEDED, "numpy": False}))
    assert "Aug.__getitem__" in finding.message and "NumPy's global RNG" in finding.message
    assert "Python's global random" not in finding.message  # seeded: not named
    assert "np.random.seed(0)" in finding.fix and "seed_everything(0, workers=True)" in finding.fix
    (hf,) = audit_settings(_settings(dataloaders=[{**loader, "framework": "transformers"}], seeded=_UNSEEDED))
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
    findings = audit_settings(
        _settings(dataloaders=[{"num_workers": 0, "sampler": "RandomSampler", **loader}])
    )
    assert [f.fix.startswith(fix) for f in findings] == ([] if fix is None else [True])
    if loader.get("generator") and loader.get("sampler_given"):
        assert "does not reach it" in findings[0].message


def test_seed_drawn_from_an_unseeded_source() -> None:
    call = {"call": "torch.manual_seed", "rng": "torch", "location": "train.py:3", "source": "random.randint"}
    (finding,) = audit_settings(_settings(tainted_seeds=[call]))
    assert (finding.code, finding.severity, finding.location) == ("TR305", "warning", "train.py:3")
    assert "random.randint" in finding.message and "torch's global RNG" in finding.message


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
    assert errors == ([] if fixed else ["TR102", "TR106", "TR107"])
