"""What every watcher of the audit's probe shares: the protocol, the process clock, a few helpers.

Invariants:
- A watcher (``Watcher``) owns its state and the patches that fill it: ``install`` patches
  (called once per process, before the user's code runs), ``after_fork`` forgets what a fork
  of this process must not inherit (what it counted and saw; what the parent set stays), and
  ``collect`` returns its ``audit.settings.ProbeSettings`` fields, read now. No two watchers
  return the same field; the package face (``_child.probe``) composes them.
- A patch only notes values and calls through to the original unchanged (one exception, asked
  for: see ``switches``); what it notes never raises into the script.
- ``PACKAGE_DIR`` is the probe's own code: a call from it is never the script's.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from torchrepro._frames import user_site

__all__ = ["GLOBAL_RNGS", "PACKAGE_DIR", "Clock", "Watcher", "code_of", "optional_numpy", "user_location"]

GLOBAL_RNGS = ("random", "numpy", "torch")
"""The global RNGs the probe tells apart, by the name findings use."""
PACKAGE_DIR = os.path.dirname(__file__)
"""The directory of the probe's modules, as their code objects name it."""


class Watcher(Protocol):
    """One concern of the probe: what it patches, what a fork forgets, the fields it reports."""

    def install(self) -> None:
        """Patch what it watches (once per process, before the user's code runs)."""

    def after_fork(self) -> None:
        """In a fork of this process: forget what the fork must not report as its own."""

    def collect(self) -> dict[str, Any]:
        """Its fields of ``ProbeSettings``, read now."""


class Clock:
    """This process's clock of starts, joins and shared updates (a fork's starts again at 0)."""

    def __init__(self) -> None:
        self.now = 0

    def tick(self) -> int:
        self.now += 1
        return self.now

    def reset(self) -> None:
        self.now = 0


def user_location() -> str | None:
    """``file:line`` of the user's line (see ``_frames.user_site``)."""
    return user_site(outer=False)[0]


def code_of(function: Any) -> Any:
    """A function's code object (typed loosely: ``functools.wraps`` hides it from mypy)."""
    return function.__code__


def optional_numpy() -> Any:
    """NumPy when it is installed, else None."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy
