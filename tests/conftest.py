"""Warnings that describe the machine the suite runs on, not the code under test.

The suite runs with ``filterwarnings = error`` (pyproject.toml). A warning whose appearance depends
on the machine would make a test pass on one machine and fail on another, so it is ignored here,
for every test under ``tests/``, with the reason:

- torch's ``DataLoader`` warns when ``num_workers`` exceeds the CPUs this process may run on ("This
  DataLoader will create 2 worker processes in total. Our suggested max number of worker in
  current system is 1"): a test loading with 2 workers failed on a 1-CPU machine (or under
  ``taskset -c 0``) and passed on this 2-core one. The batches are the same either way.

The scripts the tests run in subprocesses that turn warnings into errors themselves ignore the
same warning (``tests/e2e/loop_scripts/loop_shapes.py``).

Also here: every test starts with SIGINT, SIGTERM and SIGHUP deliverable in the pytest process.
Once in a full run (not reproduced since, with each test's signal state compared before and after:
no test changed it) a worker's main thread had SIGINT blocked: a blocked mask is inherited by every
process the later tests start, so a test of Ctrl-C waited on a ``torchrepro`` that never got it,
and ``signals_held``' own test saw no ``KeyboardInterrupt``. Such a leak is undone after the test it
appeared in (and before every test), with one line on the real stderr naming that test.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

MACHINE_WARNINGS = ("ignore:This DataLoader will create:UserWarning",)
"""``filterwarnings`` specs of the warnings above."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            for spec in MACHINE_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))
    # The files with slow tests (subprocesses, torchrun) first, each file's tests in their order:
    # ``--dist loadfile --no-loadscope-reorder`` (the Makefile) hands out files in this order, so
    # the many quick in-process files come last and fill whichever worker finishes its slow files
    # first (a slow file last kept one worker busy minutes after the other had finished).
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


_DELIVERED = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
"""Signals the tests send (Ctrl-C, a terminating signal) and expect the processes they start to get."""


def _deliverable(when: str, nodeid: str) -> None:
    """Unblock ``_DELIVERED`` in this thread, and give SIGINT back to Python's handler at the
    system's level too (C code can ignore it behind Python's back); one line names the test."""
    blocked = _DELIVERED & set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    if blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        names = ", ".join(sorted(signal.Signals(s).name for s in blocked))
        print(f"tests/conftest.py: {names} blocked {when} {nodeid}; unblocked", file=sys.__stderr__)
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.default_int_handler:
        signal.signal(signal.SIGINT, handler)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _deliverable("before", item.nodeid)
    yield
    _deliverable("after", item.nodeid)
