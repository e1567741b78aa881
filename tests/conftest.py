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
"""

from __future__ import annotations

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
