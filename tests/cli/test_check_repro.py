"""``torchrepro check --repro DIR``: a standalone script of the located op, or the reason there is none.

The script must show the difference in a fresh python that cannot import torchrepro (``-I``, no
``PYTHONPATH``, started elsewhere). Its negative control, a script written for an op that gives the
same bits, is in tests/tracing/test_repro.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import check_json, torchrepro

SCRIPTS = Path(__file__).parent / "scripts"
E2E_SCRIPTS = Path(__file__).parents[1] / "e2e" / "scripts"


def test_a_thread_dependent_sum_is_written_as_a_script_that_reproduces_it(tmp_path: Path) -> None:
    code, verdict, err = check_json(
        tmp_path, "--vary", "threads", "--repro", "bug", str(SCRIPTS / "threads_sum.py")
    )
    assert code == 1, err
    assert verdict["first_divergence"]["op"] == "aten.sum.default"
    repro = verdict["repro"]
    out = tmp_path / "bug"
    assert "the difference reproduces" in repro.pop("output")  # the script's output, as the check ran it
    assert repro == {
        "directory": str(out),
        "script": str(out / "repro.py"),
        "inputs": str(out / "inputs.pt"),
        "op": "aten.sum.default",
        "calls": [1, 1, 2],
        "reproduces": True,
    }
    assert f"--repro: wrote a standalone reproduction of aten.sum.default: python {out / 'repro.py'}" in err
    assert sorted(os.listdir(out)) == ["README.txt", "inputs.pt", "repro.py"]
    assert sorted(os.listdir(tmp_path)) == [".torchrepro", "bug"]  # nothing else written
    # as a user runs it: another directory, no torchrepro on the path
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TORCHREPRO_"))}
    proc = subprocess.run(
        [sys.executable, "-I", str(out / "repro.py")], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "call 3 (2 threads) vs call 1 (1): output 0: 1 of 1 elements differ" in proc.stdout
    assert "the difference reproduces" in proc.stdout
    assert "import torchrepro" not in (out / "repro.py").read_text()


def test_the_report_of_a_thread_count_check_shows_the_op_under_both_counts(tmp_path: Path) -> None:
    code, verdict, err = check_json(
        tmp_path, "--vary", "threads", "--report", "out.html", str(SCRIPTS / "threads_sum.py")
    )
    assert code == 1, err
    # without --repro the script goes into the check's own directory: the user's files stay as they were
    repro = verdict["repro"]
    assert repro["reproduces"] is True and ".torchrepro/checks/" in repro["script"]
    assert repro["script"].endswith(os.path.join("repro", "script", "repro.py"))
    assert sorted(os.listdir(tmp_path)) == [".torchrepro", "out.html"]
    page = (tmp_path / "out.html").read_text()
    section = page[page.index('<section id="threads">') :]
    section = section[: section.index("</section>")]
    assert "aten.sum.default" in section and "1 vs 2 threads" in section
    assert '<pre id="op-result">' in section and "call 3 (2 threads) vs call 1 (1): output 0:" in section
    assert "the difference reproduces" in section


@pytest.mark.parametrize("bad", ["not empty", "a file", "--no-locate"])
def test_bad_repro_directories_are_refused_before_anything_runs(tmp_path: Path, bad: str) -> None:
    target = tmp_path / "bug"
    extra: list[str] = []
    if bad == "not empty":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    elif bad == "a file":
        target.write_text("mine")
    else:
        extra = ["--no-locate"]
    proc = torchrepro(tmp_path, "check", *extra, "--repro", "bug", str(SCRIPTS / "threads_sum.py"))
    assert proc.returncode == 2, proc.stderr
    expected = {
        "not empty": "--repro bug: the directory is not empty (notes.txt); name a new or empty directory",
        "a file": "--repro bug: exists and is not a directory",
        "--no-locate": "--repro writes a script of the op that locating finds; drop --no-locate",
    }[bad]
    assert f"torchrepro check: error: {expected}" in proc.stderr
    assert not (tmp_path / ".torchrepro").exists()  # refused before any run
    if bad == "not empty":
        assert os.listdir(target) == ["notes.txt"] and (target / "notes.txt").read_text() == "mine"
    elif bad == "a file":
        assert target.read_text() == "mine"


def test_a_random_op_gets_no_script_and_a_note_saying_why(tmp_path: Path) -> None:
    """Dropout reseeded from os.urandom: the located op differs by its RNG state, not its kernel."""
    code, verdict, err = check_json(tmp_path, "--repro", "bug", str(E2E_SCRIPTS / "manual_dropout.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["op"].startswith("aten.bernoulli")
    assert verdict["repro"] is None and not (tmp_path / "bug").exists()
    (note,) = [n for n in verdict["notes"] if n.startswith("--repro:")]
    assert note.startswith("--repro: no script written: aten.bernoulli")
    assert "draws from a random number generator" in note
    assert f"torchrepro check: {note}" in err
