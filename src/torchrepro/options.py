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
from torchrepro.nodes import Nodes

__all__ = ["ASSERT_OPTIONS", "VARY_CHOICES", "CheckOptions"]

VARY_CHOICES = ("workers", "threads", "hashseed", "world", "resume", "compile")
"""What ``--vary`` can change in later runs (``resume``: the later run is killed after a step and
started again in the files it left, ``check_resume``; ``compile``: the first run eager, the later
ones as the script compiles)."""


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
    ``resume_at``: with ``vary="resume"``, the optimizer steps after which the later run is killed
    (one killed and restarted run per point; None: the middle of the first run's steps);
    ``resume_args``: arguments added to the command that starts a killed run again.
    ``nodes``: every run spans these nodes (``nodes.Nodes``; the same check runs on every node,
    ``check_nodes``), ``nproc`` processes on each.
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
    resume_at: tuple[int, ...] | None = None
    resume_args: tuple[str, ...] = ()
    nodes: Nodes | None = None

    def __post_init__(self) -> None:
        if self.resume_at is not None:
            object.__setattr__(self, "resume_at", _steps_list(self.resume_at))
        if isinstance(self.resume_args, str):
            raise SettingsError(
                f"resume_args must be a list of arguments, got the string {self.resume_args!r} "
                "(on the command line, --resume-args takes one quoted string)"
            )
        object.__setattr__(self, "resume_args", tuple(map(str, self.resume_args)))
        if self.vary != "resume" and (self.resume_at is not None or self.resume_args):
            raise SettingsError("--resume-at and --resume-args go with --vary resume")
        if self.vary == "resume":
            if not self.isolate:
                raise SettingsError(
                    "--vary resume starts the killed run again in the files it wrote, which needs each "
                    "run's own copy of the working directory; drop --no-isolate"
                )
            if self.runs != 2:
                raise SettingsError(
                    f"--vary resume compares one uninterrupted run with resumed ones (one per --resume-at "
                    f"point); drop --runs {self.runs}"
                )
            if self.steps is not None and self.resume_at is not None and max(self.resume_at) >= self.steps:
                raise SettingsError(
                    f"--resume-at {max(self.resume_at)} is not before the last of --steps {self.steps}: "
                    "the run is killed after that step and must go on after it"
                )
        if self.runs < 2:
            raise SettingsError(f"runs must be >= 2 to compare anything, got {self.runs}")
        if self.steps is not None and self.steps < 1:
            raise SettingsError(f"steps must be >= 1, got {self.steps}")
        if self.vary is not None and self.vary not in VARY_CHOICES:
            raise SettingsError(f"vary must be one of {VARY_CHOICES} or None, got {self.vary!r}")
        if self.steps_after_divergence < 0:
            raise SettingsError(f"steps_after_divergence must be >= 0, got {self.steps_after_divergence}")
        if self.nodes is not None:
            _across_nodes(self)
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


def _steps_list(value: Any) -> tuple[int, ...]:
    """``resume_at`` as sorted distinct step counts (each >= 1); ``SettingsError`` otherwise."""
    values = (value,) if isinstance(value, int) else value
    try:
        steps = tuple(values)
    except TypeError:
        steps = ()
    if not steps or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in steps):
        raise SettingsError(
            f"resume_at must be optimizer step counts >= 1 (the run is killed after that many steps), "
            f"got {value!r}"
        )
    return tuple(sorted(set(steps)))


ASSERT_OPTIONS = tuple(
    sorted(
        set(CheckOptions.fields())
        - {
            "runs",
            "steps",
            "vary",
            "steps_after_divergence",
            "repro",
            "repro_threads",
            "poll_interval",
            "nodes",
        }
    )
)
"""The keyword options of ``assert_reproducible`` beyond ``steps``, ``vary`` and ``runs`` (which it
takes by name): ``CheckOptions``' fields but those only a report or the command line sets."""


NOT_ACROSS_NODES = ("world", "resume", "compile")
"""``--vary`` choices a check across nodes refuses (they run on one node)."""


def _across_nodes(options: CheckOptions) -> None:
    """Refuse what a check across nodes does not do, with the way to do it on one node."""
    if not isinstance(options.nodes, Nodes):
        raise SettingsError(f"nodes must be a torchrepro.nodes.Nodes, got {options.nodes!r}")
    if options.vary in NOT_ACROSS_NODES:
        raise SettingsError(
            f"--vary {options.vary} is not supported across nodes (--nnodes {options.nodes.nnodes}); "
            f"check it on one node: torchrepro check --vary {options.vary} --nproc N script.py"
        )
    if options.repro is not None:
        raise SettingsError(
            "--repro is not supported across nodes: check on one node with --repro DIR to write the "
            "standalone script"
        )
