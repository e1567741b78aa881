"""The audit's settings probe in the audited process: one watcher per concern, composed.

What it notes, each part stating its invariants:

- ``probe.switches``: settings and the user's lines that set each determinism switch (and the
  switch statements that did not run); ``use_deterministic_algorithms`` applied warn-only.
- ``probe.compile``: ``torch.compile`` calls; ``probe.conditions``: the calls whose arguments
  decide an op-table condition.
- ``probe.seeds``: seeding calls (the global RNGs, ``torch.Generator`` through a subclass,
  ``np.random.default_rng``) and the unseeded sources a seed may come from, with their lines.
- ``probe.loaders``: DataLoaders, their sampler, and (``probe.datasets``) which global RNGs their
  dataset draws from and the line that draws.
- ``probe.steps``: training steps (optimizer steps, and the session's backward steps).
- ``probe.processes``: the processes started and joined (a fork gets a record of its own);
  ``probe.shared``: ``share_memory()`` calls and steps on parameters in shared memory.
- ``probe.watcher``: what they share (the ``Watcher`` protocol, the process clock).
- ``probe.settings_probe``: ``SettingsProbe`` registers the watchers and writes what they saw as
  ``audit.settings.ProbeSettings``; ``install_probe`` installs it once per process.

Submodules load lazily on first use of a public name: importing this package imports none of
them, and patches nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro._child.probe.settings_probe import SettingsProbe, install_probe, installed_probe

__all__ = ["SettingsProbe", "install_probe", "installed_probe"]

_WHERE = {
    "SettingsProbe": "settings_probe",
    "install_probe": "settings_probe",
    "installed_probe": "settings_probe",
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, __all__)
