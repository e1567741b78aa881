"""A finding and the report's rules (``audit.findings``): one finding per cause (code, op and
location), the modules it covers named in one string, and the report's order."""

from __future__ import annotations

import dataclasses

import pytest

from torchrepro.audit.findings import Finding, collapse, name_modules, sort_key

LN = "aten.native_layer_norm_backward"


@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        ([], None),
        ([None], None),
        (["norm"], "norm"),
        (["norm", "norm"], "norm"),
        ([f"blocks.{i}.norm1" for i in range(12)], "blocks.[0-11].norm1 (12 modules)"),
        # backward meets the blocks last to first: named in the model's order
        ([f"blocks.{i}.norm1" for i in reversed(range(12))], "blocks.[0-11].norm1 (12 modules)"),
        (
            [f"blocks.{i}.norm{j}" for i in range(12) for j in (1, 2)] + ["norm"],
            "blocks.[0-11].norm1, blocks.[0-11].norm2, norm (25 modules)",
        ),
        (
            ["layers.0.attn", "layers.2.attn", "layers.3.attn", "head"],
            "head, layers.[0,2-3].attn (4 modules)",
        ),
        (["layer1.0.bn1", "layer2.0.bn1"], "layer1.0.bn1, layer2.0.bn1 (2 modules)"),  # not list indices
        (["enc.01.ln", "enc.1.ln"], "enc.1.ln, enc.01.ln (2 modules)"),  # "01" is a key, not an index
        # a full grid of two indices folds both; an incomplete one folds the last per prefix
        ([f"s.{i}.b.{j}" for i in range(2) for j in range(3)], "s.[0-1].b.[0-2] (6 modules)"),
        (["s.0.b.0", "s.0.b.1", "s.1.b.0"], "s.0.b.[0-1], s.1.b.0 (3 modules)"),
        (["net.pool", None], "net.pool; also outside any module"),
        (["a.0.p", None, "a.1.p"], "a.[0-1].p (2 modules); also outside any module"),
    ],
)
def test_name_modules_names_every_module_once(modules: list[str | None], expected: str | None) -> None:
    assert name_modules(modules) == expected


def _f(
    code: str = "TR602", module: str | None = "blocks.0.norm1", location: str = "m.py:9", **kw: str
) -> Finding:
    fields = {"severity": "info", "op": LN, "message": "LayerNorm backward.", "fix": "Pin the threads.", **kw}
    return Finding(code, fields["severity"], fields["op"], module, location, fields["message"], fields["fix"])


def test_collapse_merges_one_cause_and_names_its_modules() -> None:
    same = [_f(module=f"blocks.{i}.norm1") for i in range(12)]
    (merged,) = collapse(same)
    assert merged == dataclasses.replace(same[0], module="blocks.[0-11].norm1 (12 modules)")
    assert collapse([same[0], same[0]]) == [same[0]]  # duplicates (one per process): one, as it was


def test_collapse_keeps_findings_of_other_lines_ops_and_codes_apart() -> None:
    findings = [
        _f(location="m.py:9"),
        _f(location="m.py:10", module="blocks.0.norm2"),  # another line: another cause
        _f(op="aten.native_layer_norm"),  # another op at the line
        _f(code="TR601", op="aten.sum"),
        _f(location="m.py:9", module="blocks.1.norm1"),  # joins the first
    ]
    out = collapse(findings)
    assert [(f.code, f.op, f.location, f.module) for f in out] == [
        ("TR602", LN, "m.py:9", "blocks.[0-1].norm1 (2 modules)"),
        ("TR602", LN, "m.py:10", "blocks.0.norm2"),
        ("TR602", "aten.native_layer_norm", "m.py:9", "blocks.0.norm1"),
        ("TR601", "aten.sum", "m.py:9", "blocks.0.norm1"),
    ]
    assert collapse(out) == out


def test_collapse_keeps_the_most_severe_and_every_distinct_message() -> None:
    info = _f("TR305", module=None, message="random.seed seeds from the clock.", fix="Seed with 0.")
    warning = dataclasses.replace(info, severity="warning", message="np.random.seed seeds from the clock.")
    (merged,) = collapse([info, warning, info])
    assert merged.severity == "warning" and merged.module is None
    assert (
        merged.message == "np.random.seed seeds from the clock. Also here: random.seed seeds from the clock."
    )
    assert merged.fix == "Seed with 0."


def test_the_order_is_severity_code_location_op() -> None:
    findings = [
        _f("TR602", location="b.py:1"),
        _f("TR102", severity="error", location="z.py:1"),
        _f("TR602", location="a.py:1"),
        _f("TR601", location="c.py:1"),
    ]
    assert [(f.code, f.location) for f in sorted(findings, key=sort_key)] == [
        ("TR102", "z.py:1"),
        ("TR601", "c.py:1"),
        ("TR602", "a.py:1"),
        ("TR602", "b.py:1"),
    ]
