"""The ``optable`` section of the GPU validation (``benchmarks/gpu_checks/optable.py``): a case for
every entry of the op table, ``compare`` on recorded results, and the whole section on the CPU."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_checks import optable
from gpu_checks.common import Context, Row

from torchrepro.audit.optable import _TABLE_FILE, load_table

_ENTRIES = json.loads(_TABLE_FILE.read_text(encoding="utf-8"))["entries"]


def _op_in(op: str, listed: list[str]) -> bool:
    """Whether ``op`` ("aten.x" or "aten.x.overload") is one of an entry's ops (same rule as the audit)."""
    name, _, overload = op.partition(".")[2].partition(".")
    for spec in listed:
        s_name, _, s_overload = spec.partition(".")[2].partition(".")
        if s_name == name and (not s_overload or s_overload == overload):
            return True
    return False


# --------------------------------------------------------------------------------------------
# Every entry of the table has cases


def test_every_code_of_the_table_has_a_case_where_it_applies() -> None:
    applies = {c.code for c in optable.CASES if c.applies}
    missing = sorted(e["code"] for e in _ENTRIES if e["code"] not in applies)
    assert missing == [], f"entries of ops_table.json without a case in gpu_checks/optable.py: {missing}"


def test_every_conditional_entry_has_a_case_where_the_condition_is_not_met() -> None:
    not_met = {c.code for c in optable.CASES if not c.applies}
    # entries that split one op by the value of an argument (scatter's reduce='add' / 'multiply')
    # are each other's not-met case: a case of one with the other's value is the other's met case
    by_ops: dict[tuple[str, ...], list[str]] = {}
    for e in _ENTRIES:
        if e.get("condition"):
            by_ops.setdefault(tuple(o["op"] for o in e["ops"]), []).append(e["code"])
    met = {c.code for c in optable.CASES if c.applies}
    complementary = {
        code for codes in by_ops.values() if len(codes) > 1 and set(codes) <= met for code in codes
    }
    missing = sorted(
        e["code"]
        for e in _ENTRIES
        if e.get("condition") and e["code"] not in not_met and e["code"] not in complementary
    )
    assert missing == [], f"conditional entries without a case where the condition is not met: {missing}"


def test_the_op_of_each_case_is_one_of_its_entry_s_ops() -> None:
    ops = {e["code"]: [o["op"] for o in e["ops"]] for e in _ENTRIES}
    wrong = [
        (c.code, c.name, c.op)
        for c in optable.CASES
        if c.code is not None and c.applies and not _op_in(c.op, ops.get(c.code, []))
    ]
    assert wrong == []
    unknown = sorted({c.code for c in optable.CASES if c.code is not None} - set(ops))
    assert unknown == [], f"cases name codes the table does not have: {unknown}"


def test_case_names_are_unique_and_unflagged_ops_are_not_in_the_table() -> None:
    names = [c.name for c in optable.CASES]
    assert len(names) == len(set(names))
    all_ops = [o["op"] for e in _ENTRIES for o in e["ops"]]
    flagged = [c.op for c in optable.CASES if c.code is None and _op_in(c.op, all_ops)]
    assert flagged == [], f"'unflagged' cases whose op the table lists: {flagged}"


# --------------------------------------------------------------------------------------------
# compare() on recorded results


def _rec(
    code: str | None, case: str, op: str, outcome: str, equal: bool | None = True, **kw: Any
) -> dict[str, Any]:
    return {
        "code": code,
        "case": case,
        "op": op,
        "applies": True,
        "device": "cuda",
        "ran_on": "cuda",
        "torch": "2.13.0+cu130",
        "outcome": outcome,
        "message": "",
        "equal_bits": None if outcome == "raises" else equal,
        "equal_bits_off": False,
        "calls": 3,
        "seconds": 0.1,
        **kw,
    }


AGREE = [
    _rec("TR113", "bincount with weights", "aten.bincount", "raises", message="bincount ... deterministic"),
    _rec("TR113", "bincount without weights", "aten.bincount", "runs", applies=False),
    _rec("TR116", "cumsum int64", "aten.cumsum", "runs", applies=False),
    _rec("TR116", "cumsum float32", "aten.cumsum", "raises"),
    _rec("TR123", "index_put_ accumulate=False", "aten.index_put_", "runs"),
    _rec("TR121", "replication_pad1d backward", "aten.replication_pad1d_backward", "runs"),
    _rec("TR130", "sdpa flash backward", "aten._scaled_dot_product_flash_attention_backward", "runs"),
    _rec(None, "mm", "aten.mm", "runs"),
    # not compared: another device, a case that broke
    _rec("TR113", "bincount with weights (cpu)", "aten.bincount", "runs", device="cpu"),
    _rec(None, "relu (broke)", "aten.relu", "error", equal=None),
]

DISAGREE = [
    _rec("TR113", "bincount with weights", "aten.bincount", "runs"),
    _rec("TR112", "histc", "aten.histc", "warns", equal=False),
    _rec("TR125", "index_add_ 1-d", "aten.index_add_", "runs", equal=False),
    _rec("TR120", "conv2d forward and backward", "aten.convolution", "raises"),
    _rec("TR119", "kthvalue", "aten.kthvalue", "raises"),  # not listed in 2.13: expected fine
    _rec("TR113", "bincount without weights", "aten.bincount", "raises", applies=False),
    _rec(
        "TR130", "sdpa memory-efficient backward", "aten._efficient_attention_backward", "runs", equal=False
    ),
    _rec(None, "mm", "aten.mm", "warns"),
    _rec(None, "relu", "aten.relu", "runs", equal=False),
]


def _summary(found: list[optable.Disagreement]) -> list[tuple[str | None, str, str, str]]:
    return [(d.code, d.case, d.expected, d.observed) for d in found]


def test_compare_finds_nothing_when_the_records_agree_with_the_table() -> None:
    assert optable.compare(AGREE, load_table("2.13", measured=False)) == []


def test_compare_lists_every_kind_of_disagreement() -> None:
    found = optable.compare(DISAGREE, load_table("2.13", measured=False))
    assert _summary(found) == [
        ("TR113", "bincount with weights", "raises", "ran without raising, equal bits"),
        ("TR112", "histc", "raises", "ran without raising (warned), unequal bits"),
        ("TR125", "index_add_ 1-d", "deterministic", "unequal bits under strict mode (3 calls)"),
        ("TR120", "conv2d forward and backward", "deterministic", "raised"),
        ("TR119", "kthvalue", "deterministic", "raised"),
        ("TR113", "bincount without weights", "deterministic", "raised"),
        (
            "TR130",
            "sdpa memory-efficient backward",
            "deterministic",
            "unequal bits under strict mode (3 calls)",
        ),
        (None, "mm", "deterministic", "warned about determinism"),
        (None, "relu", "deterministic", "unequal bits under strict mode (3 calls)"),
    ]
    assert {d.torch for d in found} == {"2.13.0+cu130"}
    assert "not in TR119's lists" in found[4].why and "torch 2.13" in found[4].why
    assert "condition is not met" in found[5].why
    assert all(json.loads(json.dumps(d.to_json())) == d.to_json() for d in found)


def test_compare_reads_the_claims_of_the_release_it_is_given() -> None:
    cumsum = [_rec("TR116", "cumsum float32", "aten.cumsum", "raises")]
    kthvalue = [_rec("TR119", "kthvalue", "aten.kthvalue", "raises")]
    maxpool3d = [_rec("TR129", "max_pool3d backward", "aten.max_pool3d_with_indices_backward", "raises")]
    # 2.14 makes cumsum deterministic; 2.4 lists kthvalue and max_pool3d's backward as raising
    assert _summary(optable.compare(cumsum, load_table("2.14"))) == [
        ("TR116", "cumsum float32", "deterministic", "raised")
    ]
    assert optable.compare(kthvalue + maxpool3d, load_table("2.4")) == []
    assert len(optable.compare(maxpool3d, load_table("2.13", measured=False))) == 1
    assert optable.compare(cumsum, load_table("2.14"), torch_version="2.11.0")[0].torch == "2.11.0"


def test_rows_on_cuda_pass_fail_or_error_by_record() -> None:
    records = [AGREE[0], DISAGREE[0], AGREE[-1]]
    rows = optable.rows_of(
        records, load_table("2.13", measured=False), "cuda", {"torch": "2.13.0+cu130", "cuda": "13.0"}
    )
    assert [r.status for r in rows] == ["pass", "fail", "error", "fail"]
    summary = rows[-1]
    assert summary.check == "op table agrees with this GPU"
    assert summary.data["torch"] == "2.13.0+cu130" and summary.data["cuda"] == "13.0"
    assert [d["case"] for d in summary.data["disagreements"]] == ["bincount with weights"]
    assert "1 case(s) broke" in summary.detail
    agreeing = optable.rows_of(AGREE[:2], load_table("2.13", measured=False), "cuda")
    assert [r.status for r in agreeing] == ["pass", "pass", "pass"]


# --------------------------------------------------------------------------------------------
# The section on the CPU


def test_the_section_runs_every_case_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    rows = optable.run(Context("cpu", True, tmp_path))
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ, "the section must unset what it set"
    *cases, summary = rows
    assert [r.data["case"] for r in cases] == [c.name for c in optable.CASES]
    broken = [(r.check, r.detail) for r in rows if r.status == "error"]
    assert broken == []
    assert {r.status for r in cases} == {"info"}
    assert summary.status == "skip" and "about CUDA" in summary.detail
    assert summary.data["cublas_workspace_config"]["set_by"] == "this section"
    assert summary.data["disagreements"] == []  # nothing is compared on the CPU
    for r in rows:
        assert json.loads(json.dumps(r.to_json())) == r.to_json()
    by_name = {r.data["case"]: r.data for r in cases}
    # what strict mode raises for on the CPU too, in every supported torch
    for name in ("max_unpool2d", "put_ accumulate=False", "resize_ of a quantized tensor"):
        assert by_name[name]["outcome"] == "raises", by_name[name]
    assert by_name["mm"]["outcome"] == "runs" and by_name["mm"]["equal_bits"] is True


@pytest.mark.requires_cuda
def test_the_section_runs_every_case_on_cuda(tmp_path: Path) -> None:
    rows = optable.run(Context("cuda", True, tmp_path))
    broken = [(r.check, r.detail) for r in rows if r.status == "error"]
    assert broken == []
    assert rows[-1].status in ("pass", "fail")
    assert rows[-1].data["cuda"] == torch.version.cuda


def test_recheck_works_the_verdicts_out_anew_for_the_recorded_torch() -> None:
    cumsum = _rec("TR116", "cumsum float32", "aten.cumsum", "raises")
    saved = optable.rows_of(
        [cumsum, AGREE[0]], load_table("2.13", measured=False), "cuda", {"torch": "2.14.0+cu130"}
    )
    assert [r.status for r in saved] == ["pass", "pass", "pass"]  # judged with 2.13's lists
    other = Row("bitwise", "cnn", "pass")
    rows = optable.recheck([other, *[Row.from_json(r.to_json()) for r in saved]])
    # torch 2.14 (no saved documentation: torchrepro's copy of it) makes cumsum deterministic
    assert [(r.section, r.status) for r in rows] == [
        ("bitwise", "pass"),
        ("optable", "fail"),
        ("optable", "pass"),
        ("optable", "fail"),
    ]
    assert rows[-1].data["table"] == "torchrepro's copy of the torch 2.14 documentation"
    assert [d["case"] for d in rows[-1].data["disagreements"]] == ["cumsum float32"]
    assert optable.recheck([other]) == [other]
