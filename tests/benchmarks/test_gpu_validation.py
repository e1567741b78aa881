"""The GPU validation's CPU side: argument handling, the no-GPU exit, the table from recorded
results, and every section's harness run on the CPU, so the first GPU runs it unchanged.

The no-GPU exit and the table from recorded results run ``main`` in this process (they start no
section: a subprocess would only import torch again); bad arguments and the harness run the script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import ROOT, user_env

sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_validation
from gpu_checks import bitwise, costs, cublas, models
from gpu_checks import tests as cuda_tests
from gpu_checks.common import ChildResult, Row

SCRIPT = ROOT / "benchmarks" / "gpu_validation.py"


def _script(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=cwd,
        env=user_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``gpu_validation.py ARGS`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = gpu_validation.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(capsys)
    assert code == 0, err
    assert "No CUDA device is visible" in out and "--device cpu --quick" in out
    code, out, err = _main(capsys, "--device", "cuda")
    assert code == 2 and "no CUDA device is visible" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sections", "bitwise,nope"], "unknown section(s) nope"),
        (["--sections", ","], "(none given)"),
        (["--json", "missing/out.json"], "folder missing does not exist"),
        (["--markdown", "."], "is a directory"),
        (["--from-json", "absent.json"], "no such file"),
        (["--device", "tpu"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_saying_what_was_wrong(tmp_path: Path, args: list[str], message: str) -> None:
    proc = _script(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def _recorded(rows: list[Row]) -> dict[str, Any]:
    return {
        "device": "cuda",
        "quick": False,
        "machine": {
            "torch": "2.11.0",
            "cuda": "13.0",
            "gpu": "NVIDIA H100 80GB HBM3",
            "cudnn": 91000,
            "driver": "580",
        },
        "seconds": 200.0,
        "rows": [r.to_json() for r in rows],
    }


def test_a_recorded_result_prints_again_with_its_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = [
        Row("bitwise", "cnn, strict: two fresh processes end with equal bits", "pass", "equal bits"),
        Row("costs", "cnn: cost of each switch", "info", "strict vs fast 1.31x"),
    ]
    saved = tmp_path / "good.json"
    saved.write_text(json.dumps(_recorded(good)))
    md = tmp_path / "table.md"
    code, out, err = _main(capsys, "--from-json", str(saved), "--markdown", str(md))
    assert code == 0, err
    assert "NVIDIA H100 80GB HBM3" in out and "PASS  bitwise" in out
    assert "| PASS | bitwise | cnn, strict" in md.read_text()
    bad = [*good, Row("cublas", "too late", "fail", "raised nothing")]
    saved.write_text(json.dumps(_recorded(bad)))
    code, out, err = _main(capsys, "--from-json", str(saved))
    assert code == 1 and "FAIL  cublas" in out
    saved.write_text(json.dumps({"rows": [{"nope": 1}]}))
    code, out, err = _main(capsys, "--from-json", str(saved))
    assert code == 2 and "is not a result this script wrote" in err


@pytest.mark.slow
def test_the_harness_runs_every_timing_and_process_section_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    # the CPU self-test on any machine: with a GPU visible, the "tests" section's pytest would run
    # the requires_cuda tests for real (pass or fail rows) instead of skipping them
    proc = _script(
        "--device",
        "cpu",
        "--quick",
        "--sections",
        "bitwise,cublas,costs,tests",
        "--json",
        str(out),
        cwd=tmp_path,
        CUDA_VISIBLE_DEVICES="",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = [Row.from_json(d) for d in result["rows"]]
    by_section = {s: [r for r in rows if r.section == s] for s in ("bitwise", "cublas", "costs", "tests")}
    # on the CPU nothing is a verdict about CUDA: measurements and skips, never a pass
    assert {r.status for r in rows} <= {"info", "skip"}, [r for r in rows if r.status not in ("info", "skip")]
    assert len(by_section["bitwise"]) == len(bitwise.MODES) * len(models.MODELS)
    assert all(r.detail.startswith("equal bits") for r in by_section["bitwise"])
    assert [r.status for r in by_section["cublas"]][:2] == ["skip", "info"]
    assert {r.data["model"] for r in by_section["costs"]} == set(models.MODELS)
    assert all(set(r.data["ratios"]) == set(costs.RATIOS) for r in by_section["costs"])
    tests_run = {r.check.split("::")[-1] for r in by_section["tests"]}
    assert "test_strict_mode_trains_to_equal_bits_in_two_fresh_processes" in tests_run
    assert all("needs a CUDA device" in r.detail for r in by_section["tests"])


@pytest.mark.usefixtures("rng_changes_ok")
def test_the_workloads_train_to_the_same_bits_and_a_difference_is_named() -> None:
    for name in models.MODELS:
        a = models.train(name, "tiny", 2, "cpu")
        assert models.first_difference(a, models.train(name, "tiny", 2, "cpu")) is None
        other = models.train(name, "tiny", 2, "cpu", seed=1)  # negative control: another seed
        assert (
            models.first_difference(a, other)
            == f"loss at step 0 ({a['losses'][0]!r} vs {other['losses'][0]!r})"
        )
    a = models.train("cnn", "tiny", 2, "cpu")
    b = dict(a, optimizer="0" * 32)
    assert models.first_difference(a, b) == "optimizer after the last step"


def test_strict_pairs_decide_and_the_others_are_measured() -> None:
    a = {"losses": [1.0, 2.0], "loss_bits": [1, 2], "params": "p", "optimizer": "o"}
    b = dict(a, loss_bits=[1, 3], losses=[1.0, 2.5])
    assert bitwise.compare_runs("strict", "gpt", a, a, cuda=True).status == "pass"
    row = bitwise.compare_runs("strict", "gpt", a, b, cuda=True)
    assert row.status == "fail" and row.detail == "differ: first at loss at step 1 (2.0 vs 2.5)"
    assert bitwise.compare_runs("off", "gpt", a, b, cuda=True).status == "info"
    assert bitwise.compare_runs("strict", "gpt", a, a, cuda=False).status == "info"
    refused = bitwise.compare_runs(
        "strict", "gpt", {"error": "RuntimeError: no deterministic kernel"}, a, cuda=True
    )
    assert refused.status == "fail" and "no deterministic kernel" in refused.detail


def test_the_cublas_rows_judge_what_the_children_saw() -> None:
    from gpu_checks.common import Context

    ctx = Context("cuda", False, Path("."))
    fix = "CUBLAS_WORKSPACE_CONFIG is unset and CUDA has started ... start it with `torchrepro run`"
    seen = {
        "cuda_started": True,
        "torchrepro": ["DeterminismError", fix],
        "pytorch": ["RuntimeError", "CuBLAS"],
    }
    assert cublas.too_late_row(ctx, ChildResult(0, "", "", seen)).status == "pass"
    missed = dict(seen, torchrepro=None)
    assert cublas.too_late_row(ctx, ChildResult(0, "", "", missed)).status == "fail"
    assert cublas.too_late_row(ctx, ChildResult(1, "", "boom", None)).status == "error"
    ok = {"cublas": ":4096:8", "deterministic": True, "value": 1.0}
    assert cublas.under_run_row(ctx, ChildResult(0, "", "", ok)).status == "pass"
    assert cublas.under_run_row(ctx, ChildResult(0, "", "", dict(ok, cublas=None))).status == "fail"


def test_costs_are_ratios_of_medians_side_by_side() -> None:
    times = {c: [0.010, 0.011, 0.030] for c in costs.CONFIGS}
    times["strict"] = [0.020, 0.022, 0.021]
    times["fast"] = [0.005, 0.005, 0.006]
    result = {
        "gpu": "G",
        "torch": "t",
        "cuda": "c",
        "times": {"cnn": times},
        "errors": {"cnn": {"fill": "RuntimeError: x"}},
    }
    [row] = costs.summarise(result, cuda=True)
    assert row.data["ratios"]["strict vs PyTorch defaults"] == pytest.approx(0.021 / 0.011)
    assert row.data["ratios"]["strict vs fast (benchmark + TF32)"] == pytest.approx(0.021 / 0.005)
    assert "raised: fill: RuntimeError: x" in row.detail


def test_the_cuda_tests_are_found_by_their_marker_and_read_from_junit(tmp_path: Path) -> None:
    files = {p.relative_to(ROOT).as_posix() for p in cuda_tests.cuda_test_files()}
    assert {"tests/gpu/test_cuda_determinism.py", "tests/checkpoint/test_checkpoint.py"} <= files
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.m" name="a" time="1.5"/>'
        '<testcase classname="tests.gpu.m" name="b">'
        '<failure message="AssertionError: differ&#10;more"/></testcase>'
        '<testcase classname="tests.gpu.m" name="c"><skipped message="needs a CUDA device"/></testcase>'
        "</testsuite></testsuites>"
    )
    rows = cuda_tests.rows_from_junit(junit)
    assert [(r.check, r.status, r.detail) for r in rows] == [
        ("gpu.m::a", "pass", "1.5 s"),
        ("gpu.m::b", "fail", "AssertionError: differ"),
        ("gpu.m::c", "skip", "needs a CUDA device"),
    ]
