"""The markers do what pyproject.toml says: ``requires_cuda`` skips without a device (or fails with
``--require-cuda``), ``slow`` is deselected by ``-m "not slow"`` (``make quick``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT

PROBE = """
import pytest, torch

@pytest.mark.requires_cuda
def test_needs_a_gpu():
    assert torch.cuda.is_available()

@pytest.mark.slow
def test_slow():
    pass

def test_plain():
    pass
"""


def _pytest(tmp_path: Path, *args: str) -> str:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")  # the hooks under test
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    requires_cuda: x\n    slow: y\n")
    (tmp_path / "test_probe.py").write_text(PROBE)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_requires_cuda_skips_with_the_reason_or_fails_when_required(tmp_path: Path) -> None:
    out = _pytest(tmp_path)
    assert "2 passed, 1 skipped" in out and "needs a CUDA device" in out, out
    required = _pytest(tmp_path, "--require-cuda")
    assert "1 failed, 2 passed" in required, required  # negative control: the test itself fails


def test_not_slow_deselects_the_slow_tests(tmp_path: Path) -> None:
    out = _pytest(tmp_path, "-m", "not slow", "--require-cuda", "-k", "not needs_a_gpu")
    assert "1 passed, 2 deselected" in out, out
