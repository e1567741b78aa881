"""What ``--torchrepro-report`` writes: a safe file name per test id, the verdicts as JSON and text."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from torchrepro.check import CheckResult
from torchrepro.errors import ReproAssertionError
from torchrepro.results import Coverage, Divergence
from torchrepro.testing.report import report_name, write_report


def test_report_names_are_readable_and_safe() -> None:
    assert report_name("test_a.py__test_b") == "test_a.py__test_b"  # already safe: kept as is
    name = report_name("tests/test_a.py::TestX::test_b[threads-1/2]")
    assert name.startswith("tests_test_a.py_TestX_test_b_threads-1_2-") and len(name) < 60
    assert len(report_name("t::" + "x" * 500)) <= 131


@settings(deadline=None)
@given(st.text(min_size=1, max_size=300), st.text(min_size=1, max_size=300))
def test_different_test_ids_never_share_a_report(a: str, b: str) -> None:
    names = report_name(a), report_name(b)
    assert all(n and "/" not in n and "\0" not in n and n not in (".", "..") for n in names)
    assert (names[0] == names[1]) == (a == b)


def test_the_assertion_error_survives_pickling() -> None:
    """pytest-xdist and multiprocessing move exceptions between processes."""
    import pickle

    result = CheckResult(reproducible=None, runs=2, steps_compared=0, first_divergence=None, check_dir="c")
    error = ReproAssertionError("t.py: INCONCLUSIVE", target="t.py", results=(result,), varied=("threads",))
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.target, copy.results, copy.varied) == (
        str(error),
        "t.py",
        (result,),
        ("threads",),
    )


def test_a_report_holds_every_verdict_and_the_message(tmp_path: Path) -> None:
    divergence = Divergence(step=2, rank=0, kind="compute", key="optimizer0", op="aten.mm", location="t.py:3")
    passed = CheckResult(reproducible=True, runs=2, steps_compared=4, first_divergence=None, check_dir="c/1")
    failed = CheckResult(
        reproducible=False,
        runs=2,
        steps_compared=3,
        first_divergence=divergence,
        check_dir="c/2",
        coverage=Coverage(per_rank={0: {"compute": 3}}, ranks_expected=(0,)),
    )
    failure = ReproAssertionError(
        "t.py: NOT reproducible", target="t.py", results=(passed, failed), varied=(None, "threads")
    )
    paths = write_report(tmp_path / "reports", "tests/test_t.py::test_t", failure)
    assert [p.name for p in paths] == [
        f"{report_name('tests/test_t.py::test_t')}.{s}" for s in ("json", "txt", "html")
    ]
    page = paths[2].read_text()  # the failed check's page (its records are gone: the verdict still shows)
    assert "NOT REPRODUCIBLE" in page and "aten.mm" in page and "t.py:3" in page
    data = json.loads(paths[0].read_text())
    assert data["test"] == "tests/test_t.py::test_t" and data["message"] == "t.py: NOT reproducible"
    assert [c["vary"] for c in data["checks"]] == [None, "threads"]
    assert data["checks"][1]["first_divergence"]["op"] == "aten.mm"
    assert data["checks"][1]["check_dir"] == str(Path("c/2").resolve())
    assert paths[1].read_text() == "tests/test_t.py::test_t\nt.py: NOT reproducible\n"
