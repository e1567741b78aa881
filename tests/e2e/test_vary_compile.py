"""``check --vary compile``: run 1 eager (``torch.compile`` off), run 2 compiled, on
``examples/compile_tiny.py`` (a tiny transformer language model with dropout); and a compiled run's
bits do not depend on whether Inductor's cache was cold or warm.

Ground truth without torchrepro: the script's final loss, compiled and eager, in plain python. Under
``--mode off`` Inductor draws its own random numbers, so the runs part at step 0 and the compiled
graph's first differing node is the dropout, at its line; under strict mode ``fallback_random`` is
on, the dropout masks are eager's and what is left is Inductor's float arithmetic (fused kernels,
decomposed ops), orders of magnitude smaller.

Compiling costs tens of seconds here, so the checks are shared: the cache test re-uses the Inductor
cache the strict check's compiled run filled (cold), and the plain-python ground truth the one the
``--mode off`` check's filled (plain python compiles with the same settings).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import ROOT, check_json, marked_line, torchrepro, user_env
from torchrepro.compare import compare_runs

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "compile_tiny.py"
SCRIPT = "examples/compile_tiny.py"  # as the documentation runs it, from a copy of the checkout's root
DOCUMENTED = f"torchrepro check --vary compile --mode off {SCRIPT}"
STEPS = 6

Check = tuple[int, dict[str, Any], str]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("compile")
    (d / "examples").mkdir()
    shutil.copy(EXAMPLE, d / SCRIPT)
    return d


@pytest.fixture(scope="module")
def off(work: Path) -> Check:
    return check_json(work, *DOCUMENTED.split()[2:], timeout=600)


@pytest.fixture(scope="module")
def strict(work: Path) -> Check:
    return check_json(work, "--vary", "compile", "--no-locate", SCRIPT, timeout=600)


def _cache(check: Check) -> Path:
    return Path(check[1]["compile"]["cache"])


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def test_the_documented_command_is_the_one_tested() -> None:
    """docs/check.md shows this command and its output, and does not run it itself."""
    assert DOCUMENTED in (ROOT / "docs" / "check.md").read_text(encoding="utf-8")


def test_plain_python_compiled_is_not_eager(off: Check, tmp_path: Path) -> None:
    """The ground truth the check must agree with: compiling changes this script's bits."""
    last = {}
    for name, extra in (("compiled", []), ("eager", ["--eager"])):
        env = user_env(TORCHINDUCTOR_CACHE_DIR=str(_cache(off)))
        command = [sys.executable, str(EXAMPLE), *extra]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=600)
        last[name] = out.stdout.strip().splitlines()[-1]
    assert last["compiled"] != last["eager"], last


def test_mode_off_parts_at_the_dropout(off: Check) -> None:
    code, verdict, stderr = off
    assert code == 1, stderr
    first = verdict["first_divergence"]
    assert (first["step"], first["kind"]) == (0, "compute"), verdict
    compiled = verdict["compile"]
    assert compiled["compiles"] >= 1 and compiled["fallback_random"] is False
    assert _cache(off).name == "inductor1"
    # located inside the compiled graph: the dropout node, its module and its line in the example
    assert first["op"] == "torch.nn.functional.dropout", verdict
    assert first["module"] == "drop", verdict
    assert first["location"] == f"{SCRIPT}:{marked_line(EXAMPLE, 'dropout')}", verdict
    assert "dropout" in compiled["graph"]
    assert any("Inductor draws its own random numbers" in note for note in verdict["notes"])
    # the runs went on after they parted: the difference of every step of the run
    steps = compiled["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert all(s["differing"] > 0 and s["largest"] > 0 for s in steps)
    assert verdict["varied"] == "eager vs torch.compile"


def test_strict_mode_keeps_eagers_dropout(off: Check, strict: Check) -> None:
    """fallback_random is set and recorded; what is left is arithmetic, far smaller than the dropout
    masks of ``--mode off`` (the control: the same check with the switch off)."""
    code, verdict, stderr = strict
    assert code == 1, stderr  # Inductor's fused arithmetic is not eager's either
    compiled = verdict["compile"]
    assert compiled["fallback_random"] is True and compiled["compiles"] >= 1
    first_off = off[1]["compile"]["steps"][0]["largest"]
    first_strict = compiled["steps"][0]["largest"]
    assert 0 < first_strict < first_off / 10, (first_strict, first_off)
    assert len(compiled["steps"]) == STEPS


def test_cold_and_warm_inductor_cache_give_the_same_bits(strict: Check, work: Path, tmp_path: Path) -> None:
    """The strict check's compiled run started with an empty cache and filled it; a recorded run
    served from that cache (it adds no file to it: nothing compiled afresh) has the same bits in
    every recorded tensor. The control: the same comparison finds the eager run's difference."""
    cache = _cache(strict)
    filled = _files(cache)
    assert filled, "the cold run left nothing in its cache"
    env = user_env(TORCHINDUCTOR_CACHE_DIR=str(cache))
    proc = torchrepro(work, "run", "--record", str(tmp_path / "warm"), SCRIPT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert _files(cache) == filled
    runs = Path(strict[1]["compile"]["cache"]).parent
    assert compare_runs(runs / "run1", tmp_path / "warm").reproducible is True
    assert compare_runs(runs / "run0", tmp_path / "warm").reproducible is False


def test_a_script_that_compiles_nothing_is_inconclusive(work: Path) -> None:
    code, verdict, stderr = check_json(work, "--vary", "compile", SCRIPT, "--eager", "--steps", "2")
    assert code == 3, stderr
    assert verdict["compile"]["compiles"] == 0
    assert "compiled nothing" in verdict["reason"]
