"""What the machine and the launching shell must not decide: warnings that describe the machine, a SIGINT
ignored by the shell that started the suite; and the order the files run in (slow files first).

The suite runs with ``filterwarnings = error`` (pyproject.toml). A warning whose appearance depends
on the machine would make a test pass on one machine and fail on another, so it is ignored here,
for every test under ``tests/``, with the reason:

- torch's ``DataLoader`` warns when ``num_workers`` exceeds the CPUs this process may run on ("This
  DataLoader will create 2 worker processes in total. Our suggested max number of worker in
  current system is 1"): a test loading with 2 workers failed on a 1-CPU machine (or under
  ``taskset -c 0``) and passed on this 2-core one. The batches are the same either way.

The scripts the tests run in subprocesses that turn warnings into errors themselves ignore the
same warning (``tests/e2e/loop_scripts/loop_shapes.py``).

Also here: SIGINT reaches the processes the tests start. A suite started in the background of a
non-interactive shell (``make test &``, ``nohup``) inherits SIGINT ignored (POSIX: an asynchronous
list without job control ignores SIGINT and SIGQUIT), and so would every process it starts: the
tests of Ctrl-C then waited on a ``torchrepro`` that never got it (a terminal's Ctrl-C reaches a
process whose SIGINT is not ignored). Python's handler is put back when SIGINT is ignored.
"""

from __future__ import annotations

import signal
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


if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # see the module's docstring
    signal.signal(signal.SIGINT, signal.default_int_handler)
