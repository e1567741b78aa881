"""The pytest plugin: reproducibility as a test in the user's CI.

Loaded through the ``pytest11`` entry point ``torchrepro`` wherever torchrepro is installed; off
with ``-p no:torchrepro``. It gives:

- the ``torchrepro`` fixture, a ``Checker``: ``torchrepro.assert_reproducible(target, *args, ...)``
  with the records in the test's ``tmp_path``;
- the marker ``@pytest.mark.reproducible(steps=None, vary=None, runs=2, **options)``: the marked
  test is not called in the pytest process; its function runs in fresh processes (``runs`` of
  them, per ``vary`` value) and the test fails unless they train identically. The arguments it
  asks for (fixtures, parameters) are made here and must travel as JSON values or paths;
- ``--torchrepro-report DIR``: a report per test that failed a check (``testing.report``).

Invariants: importing this module imports pytest and the standard library only (no torch, no
check machinery) so a project that never uses it starts pytest as fast as before; the marked test
takes its options from the marker only (an unknown option fails the test before anything runs).
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from torchrepro.errors import ReproAssertionError

if TYPE_CHECKING:
    from torchrepro.testing.assertion import Checker

MARKER = "reproducible"
FIXTURE = "torchrepro"
_SECTION = "torchrepro report"
"""The section a failed check's test report gets: the report files, one a line."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torchrepro", "reproducible training (torchrepro)")
    group.addoption(
        "--torchrepro-report",
        metavar="DIR",
        default=None,
        help="write a report (the verdicts as JSON and as text) into DIR for each test that fails a "
        "torchrepro reproducibility check",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(steps=None, vary=None, runs=2, **options): run this training test in fresh processes "
        "(runs of them, per vary value: threads, workers, hashseed, world, resume) and fail unless they "
        "train identically (torchrepro; options: those of torchrepro.testing.assert_reproducible)",
    )
    if config.getoption("--torchrepro-report") is not None:
        config.pluginmanager.register(_ReportSummary(config), "torchrepro-report-summary")


@pytest.fixture
def torchrepro(tmp_path: Path) -> Checker:
    """``torchrepro.assert_reproducible(target, *args, steps=, vary=, runs=, **options)``: run a
    script, ``"-m module"`` or module-level function in fresh processes and fail the test unless
    they are identical; the check records go into this test's ``tmp_path``."""
    from torchrepro.testing.assertion import Checker

    return Checker(tmp_path / "torchrepro")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A marked test gets the ``torchrepro`` fixture (its records' directory) without asking."""
    for item in items:
        if not isinstance(item, pytest.Function) or item.get_closest_marker(MARKER) is None:
            continue
        if FIXTURE not in item.fixturenames:
            item.fixturenames.append(FIXTURE)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A marked test: its function, with the arguments made here, checked in fresh processes."""
    __tracebackhide__ = True
    marker = pyfuncitem.get_closest_marker(MARKER)
    if marker is None:
        return None
    from torchrepro.testing.assertion import Checker, check_call
    from torchrepro.testing.runner import function_call

    if marker.args:
        raise TypeError(
            f"@pytest.mark.{MARKER} takes keyword options only (steps=, vary=, runs=, ...), "
            f"got {marker.args!r}"
        )
    # what pytest passes: the parameters it filled (a method's instance is made in each process)
    names = [n for n in inspect.signature(pyfuncitem.obj).parameters if n in pyfuncitem.funcargs]
    try:
        call = function_call(
            pyfuncitem.function, kwargs={n: pyfuncitem.funcargs[n] for n in names}, methods=True
        )
    except TypeError as exc:
        raise TypeError(
            f"@pytest.mark.{MARKER} runs {pyfuncitem.name} in fresh processes, and a fixture or "
            f"parameter it asks for cannot go there: {exc}"
        ) from None
    checker = pyfuncitem.funcargs[FIXTURE]
    assert isinstance(checker, Checker), f"the {FIXTURE} fixture is not torchrepro's here: {checker!r}"
    check_call(call, name=pyfuncitem.nodeid, workdir=checker.directory, **marker.kwargs)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    directory = item.config.getoption("--torchrepro-report")
    if directory is None or call.when != "call" or call.excinfo is None:
        return
    failure = call.excinfo.value
    if not isinstance(failure, ReproAssertionError):
        return
    from torchrepro.testing.report import write_report

    paths = write_report(directory, item.nodeid, failure)
    outcome.get_result().sections.append((_SECTION, "\n".join(map(str, paths))))


class _ReportSummary:
    """Counts the tests whose report carries a report section (those of xdist workers included:
    their reports reach this process) and names the directory at the end of the session."""

    def __init__(self, config: pytest.Config) -> None:
        self.directory = config.getoption("--torchrepro-report")
        self.tests: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if any(name == _SECTION for name, _ in report.sections):
            self.tests.add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.tests:
            n = len(self.tests)
            terminalreporter.write_line(
                f"torchrepro: {n} report{'s' if n != 1 else ''} of failed checks in {self.directory}"
            )
