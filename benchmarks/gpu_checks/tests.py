"""The suite's own CUDA tests: every test marked ``requires_cuda``, run with ``--require-cuda``.

Invariants:

- The files are found by their marker (every test module under ``tests/`` that names
  ``requires_cuda`` in a ``pytest.mark``), so a CUDA test added anywhere runs here unchanged.
- On CUDA, ``--require-cuda`` turns a skip for want of a device into a failure: none of these
  tests can pass by not running. On the CPU (the self-test) they are collected and skipped.
- One row per test, from pytest's JUnit XML: ``pass``, ``fail`` (with the first line of the
  failure) or ``skip`` (with the reason).
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_checks.common import ROOT, Context, Row, child_env

NAME = "tests"
MARK = "pytest.mark.requires_cuda"


def cuda_test_files(root: Path = ROOT) -> list[Path]:
    return sorted(
        p
        for p in (root / "tests").rglob("test_*.py")
        if MARK in p.read_text(encoding="utf-8") and p.name != "test_markers.py"
    )


def rows_from_junit(path: Path) -> list[Row]:
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".replace("tests.", "", 1)
        seconds = float(case.get("time", 0) or 0)
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            message = (failed.get("message") or failed.text or "").strip().splitlines()
            rows.append(
                Row(NAME, name, "fail", message[0][:400] if message else "failed", {"seconds": seconds})
            )
        elif skipped is not None:
            rows.append(
                Row(NAME, name, "skip", (skipped.get("message") or "skipped")[:300], {"seconds": seconds})
            )
        else:
            rows.append(Row(NAME, name, "pass", f"{seconds:.1f} s", {"seconds": seconds}))
    return rows


def run(ctx: Context) -> list[Row]:
    files = cuda_test_files()
    junit = ctx.workdir / "junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-m",
        "requires_cuda",
        f"--junitxml={junit}",
        "-o",
        "addopts=--strict-markers -ra",
        *[str(f.relative_to(ROOT)) for f in files],
    ] + (["--require-cuda"] if ctx.cuda else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=280)
    if not junit.is_file():
        tail = (proc.stdout.strip() + "\n" + proc.stderr.strip())[-1500:]
        return [Row(NAME, "pytest", "error", f"exit {proc.returncode}, no report: {tail}")]
    rows = rows_from_junit(junit)
    if not rows:
        return [Row(NAME, "pytest", "error", f"no test collected from {', '.join(map(str, files))}")]
    return rows
