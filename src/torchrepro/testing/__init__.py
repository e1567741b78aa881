"""Reproducibility as a test: ``assert_reproducible`` and the pytest plugin.

- ``torchrepro.testing.assertion``: ``assert_reproducible(target, *args, steps=, vary=, runs=,
  **options)`` runs a script, ``"-m module"`` or a module-level function in fresh processes
  (``torchrepro check``) and raises ``ReproAssertionError`` (an ``AssertionError``) with the
  verdict unless the runs are identical; ``Checker``, the pytest fixture's object.
- ``torchrepro.testing.runner``: a function as a generated runner script.
- ``torchrepro.testing.plugin``: the pytest plugin (entry point ``torchrepro``; off with
  ``-p no:torchrepro``): the ``torchrepro`` fixture, ``@pytest.mark.reproducible``,
  ``--torchrepro-report DIR`` (``torchrepro.testing.report``).

Submodules load lazily: importing ``torchrepro.testing`` imports none of them, and none imports
torch in the process that runs the tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro.testing.assertion import Checker, assert_reproducible

__all__ = ["Checker", "assert_reproducible"]

_WHERE = {"Checker": "assertion", "assert_reproducible": "assertion"}

__getattr__, __dir__ = lazy_exports(__name__, _WHERE, __all__)
