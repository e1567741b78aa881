"""The probe's face (``_child.probe``): its watchers together report every field of the record
once, a fork's record is its own, and importing the package loads and patches nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from torchrepro import runrecord
from torchrepro._child.probe import SettingsProbe
from torchrepro.audit.settings import ProbeSettings


def test_the_watchers_report_every_field_once(tmp_path: Path) -> None:
    probe = SettingsProbe(str(tmp_path / "probe.json"))  # not installed: nothing is patched
    reported = [name for watcher in probe.watchers for name in watcher.collect()]
    assert len(reported) == len(set(reported)), "a field reported by two watchers"
    # ``processes`` is filled when the processes' records are merged, never by a probe
    assert set(reported) == {f.name for f in dataclasses.fields(ProbeSettings)} - {"processes"}


def test_a_fork_keeps_what_was_set_and_counts_its_own(tmp_path: Path) -> None:
    path = str(tmp_path / "probe.json")
    probe = SettingsProbe(path)
    probe.seeds.on_seed("random", "random.seed", 5)  # an untainted seeding: inherited
    probe.seeds.on_seed("numpy", "np.random.seed", None)  # tainted: the parent's finding
    probe.steps.optimizer_steps = 2
    probe.compiles.calls.append({"location": "train.py:3", "backend": "inductor", "mode": None})
    probe.processes.started.append({"pid": 1, "started": probe.processes.clock.tick()})
    probe.after_fork()  # what ``os.register_at_fork`` runs in the child
    seen = probe.snapshot()
    assert probe.path == str(runrecord.process_path(path, os.getpid()))
    assert (seen.process["main"], seen.process["start_method"]) == (False, "fork")
    assert (seen.optimizer_steps, seen.compile_calls, seen.started, seen.tainted_seeds) == (0, (), (), ())
    assert (seen.seeded["random"], seen.seeded["numpy"]) == (True, False)
    assert probe.processes.clock.tick() == 1  # the fork's clock starts again


def test_importing_the_probe_loads_no_watcher() -> None:
    code = (
        "import sys, json; import torchrepro._child.probe; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('torchrepro'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [
        "torchrepro",
        "torchrepro._child",
        "torchrepro._child.probe",
        "torchrepro._lazy",
    ]
