"""Run-record events: format, incremental reading, digests (hooks are tested in tests/cli)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchrepro.compare import first_divergence
from torchrepro.recorder import SAMPLE_SIZE, Recorder, record
from torchrepro.runrecord import EventTail, events_path, new_run_id, read_events


def test_recorder_appends_flushed_events_readable_while_open(tmp_path: Path) -> None:
    rec = Recorder(events_path(tmp_path, 0), values_max=4)
    rec.write("init", "optimizer0", 0, [torch.zeros(3), torch.ones(10)])
    # flushed immediately: readable before close, as a live tail needs
    events = read_events(tmp_path / "events.rank0.jsonl")
    assert len(events) == 1
    event = events[0]
    assert (event["kind"], event["key"], event["step"]) == ("init", "optimizer0", 0)
    assert event["t"][0]["v"] == [0.0, 0.0, 0.0]  # small tensors keep their values
    assert "v" not in event["t"][1]  # large ones only their fingerprint
    assert event["t"][1]["shape"] == [10] and event["t"][1]["dtype"] == "float32"
    rec.close()
    rec.close()  # idempotent


def test_large_floating_tensors_keep_an_evenly_spaced_sample(tmp_path: Path) -> None:
    rec = Recorder(events_path(tmp_path, 0), values_max=4)
    big = torch.arange(100.0).view(10, 10)
    rec.write("data", "loader0", 0, [big, torch.arange(100), big.t(), torch.arange(3.0)])
    rec.close()
    floating, integer, transposed, small = read_events(events_path(tmp_path, 0))[0]["t"]
    assert floating["s"] == [float(i) for i in range(0, 100, 100 // SAMPLE_SIZE)][:SAMPLE_SIZE]
    assert "v" not in floating
    assert "s" not in integer and "s" not in transposed  # floating and contiguous only: no copy
    assert small["v"] == [0.0, 1.0, 2.0] and "s" not in small


def test_event_fingerprint_is_value_sensitive_and_layout_independent(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "e.jsonl")
    x = torch.arange(12.0).view(3, 4)
    rec.write("data", "loader0", 0, (x, torch.tensor([1, 2])))
    rec.write("data", "loader0", 0, (x.t().contiguous().t(), torch.tensor([1, 2])))
    flipped = x.clone()
    flipped.view(-1).view(torch.int32)[5] ^= 1
    rec.write("data", "loader0", 0, (flipped, torch.tensor([1, 2])))
    rec.write("data", "loader0", 0, [x, torch.tensor([1, 2])])  # a list is not a tuple
    rec.close()
    fps = [e["fp"] for e in read_events(tmp_path / "e.jsonl")]
    assert fps[0] == fps[1]
    assert len(set(fps)) == 3


def test_torn_last_line_of_a_crashed_run_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "events.rank0.jsonl"
    init = {"kind": "init", "key": "optimizer0", "step": 0, "fp": "a", "t": []}
    compute = {"kind": "compute", "key": "optimizer0", "step": 0, "fp": "b", "t": []}
    text = json.dumps(compute)
    path.write_text(json.dumps(init) + "\n" + text[:12])  # '{"kind": "co'
    assert read_events(path) == [init]
    tail = EventTail(path)
    assert tail.poll() == 1
    with open(path, "a") as f:
        f.write(text[12:] + "\n")
    assert tail.poll() == 1
    assert tail.events[-1] == compute


def test_record_outside_a_recorded_run_is_a_no_op_and_validates_its_name() -> None:
    record("loss", torch.tensor(1.0))
    with pytest.raises(TypeError, match="non-empty str"):
        record("", 1)
    with pytest.raises(TypeError, match="non-empty str"):
        record(3, 1)  # type: ignore[arg-type]


def test_run_ids_are_unique() -> None:
    assert len({new_run_id() for _ in range(200)}) == 200


def test_first_divergence_between_recorded_event_lists(tmp_path: Path) -> None:
    def events(name: str, values: list[float]) -> list[dict[str, object]]:
        rec = Recorder(tmp_path / name)
        rec.write("init", "optimizer0", 0, [torch.zeros(2)])
        for step, v in enumerate(values):
            rec.write("data", "loader0", step, torch.ones(2))
            rec.write("compute", "optimizer0", step, [torch.full((2,), v)])
        rec.close()
        return read_events(tmp_path / name)

    a = events("a", [1.0, 2.0, 3.0])
    assert first_divergence(a, events("b", [1.0, 2.0, 3.0])) is None
    d = first_divergence(a, events("c", [1.0, 2.5, 3.0]), rank=1)
    assert d is not None and (d.kind, d.step, d.rank, d.key) == ("compute", 1, 1, "optimizer0")
    d = first_divergence(a, events("d", [1.0, 2.0]))  # one run stopped early
    assert d is not None and (d.kind, d.step) == ("data", 2)
