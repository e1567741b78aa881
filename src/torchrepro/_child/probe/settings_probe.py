"""``SettingsProbe``: the audit's watchers of one process, composed; the record they write.

Invariants:
- Only an audited process installs it (``_child.session.configure`` through ``install_probe``:
  the bootstrap, and each python child the script starts, ``_child.children``), once per process,
  before the user's code runs; importing this module patches nothing, and neither does making a
  ``SettingsProbe`` (``install`` does).
- The watchers are registered here, once, in ``SettingsProbe.__init__``; each owns its state,
  its patches and its fields of ``audit.settings.ProbeSettings`` (``watcher.Watcher``), and
  ``snapshot`` is their fields together.
- The process torchrepro started writes the spec's path; any other (a python child, a fork of a
  probed process) writes ``runrecord.process_path(path, pid)``: its own counts and records only
  (what a fork inherits, its seeding and switches, stays).
- The record is written after each training step, when a ``multiprocessing`` process it runs
  ends, and at exit; a DataLoader worker writes nothing. A write never raises.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import Any

from torchrepro import runrecord
from torchrepro._child.probe.compile import CompileWatcher
from torchrepro._child.probe.conditions import ConditionWatcher
from torchrepro._child.probe.loaders import LoaderWatcher
from torchrepro._child.probe.processes import ProcessWatcher
from torchrepro._child.probe.seeds import SeedWatcher
from torchrepro._child.probe.shared import SharedMemoryWatcher
from torchrepro._child.probe.steps import StepWatcher
from torchrepro._child.probe.switches import SwitchWatcher
from torchrepro._child.probe.watcher import Clock, Watcher
from torchrepro._io import atomic_write_json
from torchrepro.audit.settings import ProbeSettings

__all__ = ["SettingsProbe", "install_probe", "installed_probe"]


class SettingsProbe:
    """Watches what the audited script sets; writes it as JSON after each training step and at exit.

    ``main``: the process the audit started (writes ``path``); otherwise a python child the
    script started, or a fork of a probed process, which writes ``runrecord.process_path(path, pid)``.
    """

    def __init__(self, path: str, *, main: bool = True) -> None:
        self.base_path = path
        self.path = path if main else str(runrecord.process_path(path, os.getpid()))
        clock = Clock()  # this process's clock of starts, joins and shared updates
        self.loaders = LoaderWatcher()
        self.compiles = CompileWatcher()
        self.switches = SwitchWatcher()
        self.conditions = ConditionWatcher()
        self.seeds = SeedWatcher()
        self.processes = ProcessWatcher(main=main, clock=clock, write=self.write)
        self.shared = SharedMemoryWatcher(clock)
        self.steps = StepWatcher(self.shared, self.write)
        self.watchers: tuple[Watcher, ...] = (
            self.loaders,
            self.compiles,
            self.switches,
            self.conditions,
            self.seeds,
            self.processes,
            self.shared,
            self.steps,
        )

    @property
    def backward(self) -> Any:
        """The session's ``BackwardSteps``: the probe counts backward steps as the session does."""
        return self.steps.backward

    @backward.setter
    def backward(self, steps: Any) -> None:
        self.steps.backward = steps

    def install(self) -> None:
        """Install every watcher's patches; write at exit; a fork starts a record of its own."""
        for watcher in self.watchers:
            watcher.install()
        atexit.register(self.write)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.after_fork)

    def after_backward(self) -> None:
        """A ``backward()`` step ended (training no optimizer sees): note it and write."""
        self.steps.after_backward(sys._getframe(1))

    def snapshot(self) -> ProbeSettings:
        """What the probe has seen so far."""
        fields: dict[str, Any] = {}
        for watcher in self.watchers:
            fields.update(watcher.collect())
        return ProbeSettings(**fields)

    def write(self) -> None:
        """Write ``snapshot`` to ``path`` (atomically; never raises), unless this process writes nothing."""
        if self.processes.disabled:
            return
        with contextlib.suppress(Exception):
            atomic_write_json(self.path, self.snapshot().to_dict())

    def after_fork(self) -> None:
        """In a fork of a probed process: a process of its own, with a record of its own. What
        the parent set (seeds, switches) is inherited; what it counted and saw is not."""
        self.path = str(runrecord.process_path(self.base_path, os.getpid()))
        for watcher in self.watchers:
            watcher.after_fork()


_installed: SettingsProbe | None = None


def install_probe(path: str, *, main: bool = True) -> SettingsProbe:
    """Install the audit's probe in this process, once (a later call returns the one installed:
    a python child installs it before its parent's ``__main__`` is imported again, and its
    session finds it then)."""
    global _installed
    if _installed is None:
        probe = SettingsProbe(path, main=main)
        probe.install()
        _installed = probe
    return _installed


def installed_probe() -> SettingsProbe | None:
    """The probe installed in this process (inherited by a fork), or None."""
    return _installed
