"""``CheckOptions``: everything a check can be asked, built once at the edge and passed down.

Invariants: the command line (``torchrepro check``), ``check_script``, ``assert_reproducible`` and
the pytest marker all build one frozen ``CheckOptions`` and nothing else lists the options; a new
option is a field here, and a test ties the command line's flags to the fields. Every value is
validated when the object is built (``SettingsError``, one line naming the option and the fix),
before anything runs. Standard library only (the command line imports it at start).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from torchrepro.errors import SettingsError

__all__ = ["ASSERT_OPTIONS", "VARY_CHOICES", "CheckOptions"]

VARY_CHOICES = ("workers", "threads", "hashseed", "world")
"""What ``--vary`` can change in later runs."""


@dataclass(frozen=True)
class CheckOptions:
    """The options of a check (``torchrepro check``'s flags, ``check_script``'s keywords).

    ``runs`` compared runs (>= 2); ``steps``: stop each run after N training steps; ``nproc``: ranks
    per run through torchrun; ``seed``, ``mode`` (``strict``/``warn``/``off``), ``threads``,
    ``cpu_capability``, ``portable``: how each run starts (``no_seed``: as plain python, nothing
    seeded or switched); ``vary``: what the later runs change (``VARY_CHOICES``); ``locate``: re-run
    a ``compute`` divergence's step with op tracing; ``serial``: one run at a time; ``isolate``: each
    run writes to its own copy-on-write view of the working directory; ``root``: where the check's
    records go (None: ``runrecord.CHECKS_ROOT``, ``.torchrepro/checks`` below the working
    directory); ``steps_after_divergence``: let the runs go on that many steps after the first
    divergence (for a report's plot); ``repro``: a new or empty directory for a standalone script
    of the located op; ``repro_threads``: under ``vary="threads"``, write that script into the
    check's own directory for a report; ``poll_interval``: seconds between looks at the runs.
    """

    runs: int = 2
    steps: int | None = None
    nproc: int | None = None
    seed: int = 0
    mode: str = "strict"
    threads: int | None = None
    cpu_capability: str | None = None
    no_seed: bool = False
    vary: str | None = None
    portable: bool = False
    locate: bool = True
    serial: bool = False
    isolate: bool = True
    root: str | os.PathLike[str] | None = None
    steps_after_divergence: int = 0
    repro: str | os.PathLike[str] | None = None
    repro_threads: bool = False
    poll_interval: float = 0.05

    def __post_init__(self) -> None:
        if self.runs < 2:
            raise SettingsError(f"runs must be >= 2 to compare anything, got {self.runs}")
        if self.steps is not None and self.steps < 1:
            raise SettingsError(f"steps must be >= 1, got {self.steps}")
        if self.vary is not None and self.vary not in VARY_CHOICES:
            raise SettingsError(f"vary must be one of {VARY_CHOICES} or None, got {self.vary!r}")
        if self.steps_after_divergence < 0:
            raise SettingsError(f"steps_after_divergence must be >= 0, got {self.steps_after_divergence}")
        if self.repro is not None and not self.locate:
            raise SettingsError("--repro writes a script of the op that locating finds; drop --no-locate")

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def build(cls, options: CheckOptions | None = None, /, **changes: Any) -> CheckOptions:
        """``options`` (default: the defaults) with ``changes``; an unknown name is a ``TypeError``
        that lists the options."""
        unknown = sorted(set(changes) - set(cls.fields()))
        if unknown:
            raise TypeError(
                f"unknown check option(s) {', '.join(map(repr, unknown))}; the options are "
                f"{', '.join(cls.fields())}"
            )
        return dataclasses.replace(options if options is not None else cls(), **changes)

    def replace(self, **changes: Any) -> CheckOptions:
        """A copy with ``changes`` (validated again)."""
        return self.build(self, **changes)


ASSERT_OPTIONS = tuple(
    sorted(
        set(CheckOptions.fields())
        - {"runs", "steps", "vary", "steps_after_divergence", "repro", "repro_threads", "poll_interval"}
    )
)
"""The keyword options of ``assert_reproducible`` beyond ``steps``, ``vary`` and ``runs`` (which it
takes by name): ``CheckOptions``' fields but those only a report or the command line sets."""
