"""The thread table (``audit.threads``): what the recorder notes, the TR6xx findings, and the table
measured again on this machine.

The in-process tests run real ops under the real ``OpRecorder`` with ``facts``: each entry is noted
exactly where its condition holds (a sum of 32769 elements, not of 32768). The slow test runs the
table's examples at 1 and 2 threads in portable mode: each entry's op must differ (the table claims
nothing it cannot show) and each fix must not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import user_env
from torchrepro.audit.report import report
from torchrepro.audit.threads import DOT_THREADED, ENTRIES, GRAIN, audit_threads, facts
from torchrepro.portable import start_values
from torchrepro.tracing import OpEvent, OpRecorder

GEN = torch.Generator().manual_seed(0)


def _x(*shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).requires_grad_(grad)


def _noted(body: Callable[[], Any]) -> dict[str, list[str]]:
    """The facts the recorder notes while ``body`` runs, by op."""
    with OpRecorder(facts=facts) as recorder:
        body()
    out: dict[str, list[str]] = {}
    for event in recorder.events:
        if event.facts:
            out.setdefault(event.op, []).extend(event.facts)
    return out


def _layer_norm(rows: int, affine: bool) -> None:
    weight, bias = (_x(64, grad=True), _x(64, grad=True)) if affine else (None, None)
    F.layer_norm(_x(rows, 64, grad=True), (64,), weight, bias).sum().backward()


def _batch_norm(x: torch.Tensor, *, train: bool = True) -> None:
    bn = nn.BatchNorm1d(x.shape[1]) if x.dim() < 4 else nn.BatchNorm2d(x.shape[1])
    bn.train(train)
    bn(x.requires_grad_(True)).sum().backward()


NOTED = [
    ("sum of 32769", lambda: _x(GRAIN + 1).sum(), "aten.sum.default", f"{GRAIN + 1} elements reduced"),
    ("mean to one value", lambda: _x(4, GRAIN).mean((0, 1)), "aten.mean.dim", "131072 elements reduced"),
    ("mse_loss", lambda: F.mse_loss(_x(256, 256), _x(256, 256)), "aten.mse_loss.default", "65536 elem"),
    (
        "layer_norm backward",
        lambda: _layer_norm(8, True),
        "aten.native_layer_norm_backward.default",
        "8 rows",
    ),
    (
        "batch_norm (N, C)",
        lambda: _batch_norm(_x(16, 8)),
        "aten.native_batch_norm.default",
        "a (16, 8) input",
    ),
    (
        "batch_norm channels-last backward",
        lambda: _batch_norm(_x(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)),
        "aten.native_batch_norm_backward.default",
        "channels-last",
    ),
    ("dot", lambda: torch.dot(_x(DOT_THREADED), _x(DOT_THREADED)), "aten.dot.default", "8192 elements"),
]


@pytest.mark.parametrize(("what", "body", "op", "fact"), NOTED, ids=[n[0] for n in NOTED])
def test_the_recorder_notes_each_entry_where_its_condition_holds(
    what: str, body: Callable[[], Any], op: str, fact: str
) -> None:
    noted = _noted(body)
    assert op in noted and any(fact in f for f in noted[op]), noted


NOT_NOTED = [
    ("sum of 32768", lambda: _x(GRAIN).sum()),
    ("integer sum", lambda: torch.arange(GRAIN * 2).sum()),
    ("sum over a dim with several outputs", lambda: _x(2, GRAIN).sum(1)),
    ("layer_norm without weight and bias", lambda: _layer_norm(8, False)),
    ("layer_norm of one row", lambda: _layer_norm(1, True)),
    ("contiguous batch_norm2d", lambda: _batch_norm(_x(4, 3, 8, 8))),
    ("batch_norm (N, C, L)", lambda: _batch_norm(_x(16, 8, 4))),
    ("batch_norm in eval", lambda: _batch_norm(_x(16, 8), train=False)),
    ("short dot", lambda: torch.dot(_x(DOT_THREADED // 2), _x(DOT_THREADED // 2))),
    ("matmul", lambda: _x(1, GRAIN * 2) @ _x(GRAIN * 2, 1)),
]


@pytest.mark.parametrize(("what", "body"), NOT_NOTED, ids=[n[0] for n in NOT_NOTED])
def test_nothing_is_noted_where_the_result_was_measured_thread_invariant(
    what: str, body: Callable[[], Any]
) -> None:
    assert _noted(body) == {}


def test_a_fact_never_breaks_the_recorded_run() -> None:
    """An op of the table called with a signature the condition does not expect: nothing noted."""
    assert facts("aten.native_layer_norm_backward.default", (1, 2), {}, None) is None
    assert facts("aten.native_batch_norm.default", (object(),) * 8, {}, None) is None


def test_audit_threads_gives_one_info_per_op_and_site_with_its_facts() -> None:
    events = [
        OpEvent("aten.sum.default", None, "t.py:3", False, 2, ("40000 elements reduced to one value",)),
        OpEvent("aten.sum.default", None, "t.py:3", False, 1, ("50000 elements reduced to one value",)),
        OpEvent("aten.sum.default", None, "t.py:9", False, 1),  # no fact: nothing to say
        OpEvent("aten.native_layer_norm_backward.default", "ln", "t.py:5", True, 1, ("x over 8 rows",)),
        OpEvent("aten.relu.default", None, "t.py:3", False, 1, ("not a table op",)),
    ]
    found = audit_threads([e.to_dict() for e in events])
    assert [(f.code, f.severity, f.op, f.location) for f in found] == [
        ("TR601", "info", "aten.sum", "t.py:3"),
        ("TR602", "info", "aten.native_layer_norm_backward", "t.py:5"),
    ]
    assert found[0].message.endswith(
        "Here: 40000 elements reduced to one value; 50000 elements reduced to one value."
    )
    assert "also under --portable" in found[0].message and "Pin the thread count" in found[0].fix
    assert "(in backward; the location is its forward call)" in found[1].message
    assert audit_threads(events) == found  # OpEvent objects as well as their dicts


def test_layer_norms_run_at_one_line_are_one_finding_naming_them_all() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(8), nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.norm1(x)  # norm1-line
            return x + self.norm2(x)  # norm2-line

    blocks = nn.Sequential(*(Block() for _ in range(5)))
    with OpRecorder(facts=facts) as recorder:
        blocks(_x(4, 3, 8)).sum().backward()
    lines = Path(__file__).read_text().splitlines()
    norm1, norm2 = (
        "tests/audit/test_audit_threads.py:" + str(next(n for n, t in enumerate(lines, 1) if t.endswith(m)))
        for m in ("# norm1-line", "# norm2-line")
    )
    found = audit_threads(recorder.events)
    # control: the recording has one event per module (the report used to list one finding each)
    assert len({e.module for e in recorder.events if e.facts}) == 10
    assert [(f.code, f.location, f.module) for f in found] == [
        ("TR602", norm1, "[0-4].norm1 (5 modules)"),
        ("TR602", norm2, "[0-4].norm2 (5 modules)"),
    ]
    assert found[0].message.endswith("Here: weight/bias gradients summed over 12 rows.")


def test_the_report_lists_thread_findings_and_facts_survive_the_record() -> None:
    event = OpEvent("aten.dot.default", None, "t.py:1", False, 1, ("a dot product of 9000 elements",))
    assert OpEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event
    assert "facts" not in OpEvent("aten.dot.default", None, None, False).to_dict()  # older records' shape
    audit = report(script="t.py", steps=1, events=[event.to_dict()], settings=None)
    assert [f.code for f in audit.findings if f.code.startswith("TR6")] == ["TR604"]


def test_every_entry_has_a_free_code_a_fix_and_ops() -> None:
    codes = [e.code for e in ENTRIES]
    assert codes == sorted(set(codes)) and all(c.startswith("TR6") for c in codes)
    assert all(e.ops and e.fix.startswith("Pin the thread count") for e in ENTRIES)


# --- the table measured again ---------------------------------------------------------------------

_MEASURE = r"""
import hashlib, json, sys
import torch, torch.nn.functional as F
from torch import nn
torch.set_num_threads(int(sys.argv[1]))
torch.backends.mkldnn.enabled = False  # what portable mode's child does
g = torch.Generator().manual_seed(0)
def x(*s): return torch.randn(*s, generator=g)
def h(*ts): return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in ts)).hexdigest()
def ln(fused):
    a, w, b = x(512, 64).requires_grad_(), x(64).requires_grad_(), x(64).requires_grad_()
    y = F.layer_norm(a, (64,), w, b) if fused else F.layer_norm(a, (64,)) * w + b
    y.backward(x(512, 64)); return h(w.grad, b.grad)
def bn(transposed):
    a, bn1 = x(512, 32).requires_grad_(), nn.BatchNorm1d(32)
    y = bn1(a.t().unsqueeze(0).contiguous()).squeeze(0).t() if transposed else bn1(a)
    y.backward(x(512, 32)); return h(y, bn1.weight.grad, bn1.running_var)
s, a, b = x(10**6), x(10**6), x(10**6)
out = {
    "TR601": h(s.sum(), s.mean(), F.mse_loss(a, b)), "TR601 fix": h(s.reshape(64, -1).sum(1).sum()),
    "TR602": ln(True), "TR602 fix": ln(False),
    "TR603": bn(False), "TR603 fix": bn(True),
    "TR604": h(torch.dot(a, b)), "TR604 fix": h(a.view(1, -1) @ b.view(-1, 1)),
}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_each_entry_differs_between_one_and_two_threads_in_portable_mode_and_its_fix_does_not() -> None:
    """TR601-TR603 are ATen's own kernels (one partial sum per thread of torch's pool): they differ
    on any CPU. TR604 is oneMKL's dot product, which torch calls only where oneMKL is its BLAS (x86
    builds); elsewhere (OpenBLAS on ARM) whether a dot splits by thread is that library's choice,
    so TR604 is expected to differ only with oneMKL. Every fix must give equal bits everywhere."""
    env = user_env(**start_values({}))
    runs = [
        subprocess.run(
            [sys.executable, "-c", _MEASURE, str(n)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        for n in (1, 2)
    ]
    one, two = (json.loads(r.stdout) for r in runs)
    differ = {k for k in one if one[k] != two[k]}
    expected = {e.code for e in ENTRIES}
    if not torch.backends.mkl.is_available():
        expected -= {"TR604"} - differ  # another BLAS's dot: it may split by thread or not
    assert differ == expected
