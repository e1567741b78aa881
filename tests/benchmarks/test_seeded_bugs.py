"""The seeded-bug benchmark: every case has a bug and a clean twin that differ by the fix alone,
and a few pairs run through ``assert_reproducible`` (the whole table: ``make bench``)."""

from __future__ import annotations

import ast
import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, user_env

sys.path.insert(0, str(ROOT / "benchmarks"))

import seeded_bugs

SCRIPT = ROOT / "benchmarks" / "seeded_bugs.py"


def _code(path: Path) -> list[str]:
    """The script's code without its docstring and comments."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    tree.body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return ast.unparse(tree).splitlines()


@pytest.mark.parametrize("case", seeded_bugs.CASES, ids=[c.name for c in seeded_bugs.CASES])
def test_each_bug_has_a_clean_twin_that_differs_by_its_fix(case: seeded_bugs.Case) -> None:
    bug, clean = (seeded_bugs.CASES_DIR / f"{case.name}_{kind}.py" for kind in ("bug", "clean"))
    assert "# the bug" in bug.read_text() and "# the fix" in clean.read_text()
    diff = difflib.unified_diff(_code(bug), _code(clean), lineterm="", n=0)
    changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert 1 <= len(changed) <= 4, changed  # the fix and nothing else


@pytest.mark.slow
def test_a_few_pairs_are_caught_and_passed(tmp_path: Path) -> None:
    """A setting varied (hashseed) and a function's variant (a resume): both bugs fail, both twins
    pass (no plain runs, no locating: 8 runs)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cases", "class_order,resume_zero_grad", "--no-plain", "--no-locate"],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "seeded bugs caught: 2/2; clean twins passed: 2/2" in proc.stdout
    assert "class_order_bug.py:13" in proc.stdout  # the loader whose labels differ
    assert "compute at step 3" in proc.stdout  # the first step after the resume


def test_an_unknown_case_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cases", "nope"],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "unknown case(s) nope" in proc.stderr
