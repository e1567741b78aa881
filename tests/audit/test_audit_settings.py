"""What the audit's probe writes and the rules read (``audit.settings.ProbeSettings``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from torchrepro._child.probe import SettingsProbe
from torchrepro.audit import ProbeSettings
from torchrepro.errors import TraceError
from torchrepro.flags import DeterminismFlags

# switches the probe does not record (they decide nothing the audit reports)
_NOT_PROBED = {"fp32_precision", "fill_uninitialized_memory", "flash_attention_deterministic"}


def _snapshot(tmp_path: Path) -> dict[str, Any]:
    """The probe's record as it goes to the JSON file (the probe is not installed: nothing is patched)."""
    snapshot: Any = SettingsProbe(str(tmp_path / "probe.json")).snapshot()
    return snapshot.to_dict() if hasattr(snapshot, "to_dict") else dict(snapshot)


def test_the_probe_names_every_switch_as_determinism_flags_does(tmp_path: Path) -> None:
    recorded = _snapshot(tmp_path)
    flags = DeterminismFlags.capture()
    for field in dataclasses.fields(DeterminismFlags):
        if field.name in _NOT_PROBED:
            continue
        assert field.name in recorded, f"the probe records DeterminismFlags.{field.name} under another name"
        assert recorded[field.name] == getattr(flags, field.name), field.name
    # the dataclass both sides import: a switch field has the flags' name (no renamed copy of one)
    switches = {f.name for f in dataclasses.fields(DeterminismFlags)}
    probed = {f.name for f in dataclasses.fields(ProbeSettings)}
    assert switches - _NOT_PROBED <= probed
    assert not {n for n in probed if n.endswith("allow_tf32")} - switches


def test_round_trip_through_json(tmp_path: Path) -> None:
    recorded = _snapshot(tmp_path)
    settings = ProbeSettings.from_dict(json.loads(json.dumps(recorded)))
    assert settings.to_dict() == recorded
    loader = {"location": "train.py:9", "num_workers": 2, "probe": {"ran": True, "draws": ["random"]}}
    rich = dataclasses.replace(settings, dataloaders=(loader,), calls=({"fn": "cumsum", "floating": True},))
    assert ProbeSettings.from_dict(json.loads(json.dumps(rich.to_dict()))) == rich
    assert list(rich.to_dict()) == [f.name for f in dataclasses.fields(ProbeSettings)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cudnn_benchmark": None}, "'cudnn_benchmark' must be true or false, got None"),
        ({"num_threads": "8"}, "'num_threads' must be an integer, got '8'"),
        ({"dataloaders": {"a": 1}}, "'dataloaders' must be an array of objects"),
        ({"seeded": {"torch": 1}}, "'seeded' must be an object of true/false values"),
        ({"matmul_allow_tf32": True}, "unknown: matmul_allow_tf32"),
    ],
)
def test_a_bad_field_is_named(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    with pytest.raises(TraceError, match=message):
        ProbeSettings.from_dict({**_snapshot(tmp_path), **change})


def test_a_missing_field_is_named_not_a_key_error(tmp_path: Path) -> None:
    d = _snapshot(tmp_path)
    del d["cuda_matmul_allow_tf32"], d["warn_only"]
    with pytest.raises(TraceError, match="missing: warn_only, cuda_matmul_allow_tf32"):
        ProbeSettings.from_dict(d)
    with pytest.raises(TraceError, match="must be a JSON object, got list"):
        ProbeSettings.from_dict([])


def test_every_field_type_is_checked() -> None:
    """Control: ``from_dict`` has a check for the type of every field (a new field needs one)."""
    from torchrepro.audit import settings as module

    assert {str(f.type) for f in dataclasses.fields(ProbeSettings)} <= set(module._CHECKS)


def _process(settings: ProbeSettings, pid: int, *, main: bool = False, **changes: Any) -> ProbeSettings:
    process = {"pid": pid, "parent_pid": 1, "main": main, "target": None, "start_method": None}
    return dataclasses.replace(settings, process=process, **changes)


def test_merge_processes_sums_steps_and_judges_the_process_that_trained(tmp_path: Path) -> None:
    from torchrepro.audit.settings import merge_processes

    base = ProbeSettings.from_dict(_snapshot(tmp_path))
    starts = tuple(
        {
            "pid": pid,
            "location": "train.py:11",
            "target": "train",
            "start_method": "spawn",
            "started": i,
            "joined": None,
        }
        for i, pid in enumerate((20, 30, 40), start=1)
    )
    main = _process(base, 10, main=True, started=starts, torch_seeded=False, optimizer_steps=0)
    loader = {"location": "train.py:5", "num_workers": 0}
    kids = [
        _process(
            base, 30, optimizer_steps=1, cudnn_benchmark=True, dataloaders=(loader,), seeded={"random": True}
        ),
        _process(base, 20, optimizer_steps=1, cudnn_benchmark=True, backward_steps=2),
    ]
    merged = merge_processes(main, kids)
    assert (merged.optimizer_steps, merged.backward_steps) == (2, 2)
    # the switches are those of the first child that trained, in start order
    assert merged.process["pid"] == 20 and merged.cudnn_benchmark is True
    assert [(p["pid"], p["followed"], p["main"]) for p in merged.processes] == [
        (10, True, True),
        (20, True, False),
        (30, True, False),
        (40, False, False),  # started, wrote nothing: not followed
    ]
    assert merged.processes[1]["location"] == "train.py:11" and merged.processes[1]["target"] == "train"
    # a loader of another process keeps that process's seeding
    (merged_loader,) = merged.dataloaders
    assert merged_loader["pid"] == 30 and merged_loader["seeded"] == {"random": True}
    assert ProbeSettings.from_dict(json.loads(json.dumps(merged.to_dict()))) == merged
    # one process: its own settings, listed alone
    alone = merge_processes(main)
    assert alone.process["pid"] == 10 and [p["pid"] for p in alone.processes] == [10, 20, 30, 40]


def test_merge_processes_keeps_one_switch_statement_per_line_run_if_it_ran_anywhere(tmp_path: Path) -> None:
    from torchrepro.audit.settings import merge_processes

    base = ProbeSettings.from_dict(_snapshot(tmp_path))
    line = {"switch": "cudnn_benchmark", "value": True, "location": "train.py:7"}
    main = _process(base, 10, main=True, switch_statements=({**line, "ran": False},))
    child = _process(base, 20, optimizer_steps=1, switch_statements=({**line, "ran": True},))
    assert [s["ran"] for s in merge_processes(main, [child]).switch_statements] == [True]
    assert [s["ran"] for s in merge_processes(main).switch_statements] == [False]
