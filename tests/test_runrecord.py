"""Run records on disk: RunSettings, writers, load_run and its errors, traces, events readers."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrepro import runrecord
from torchrepro._jsonread import read_json
from torchrepro.errors import EnvFileError, ReproError
from torchrepro.runrecord import (
    COMMAND_FILE,
    ENV_FILE,
    SETTINGS_FILE,
    VERDICT_FILE,
    EventTail,
    RunSettings,
    events_path,
    load_run,
    new_run_dir,
    read_events,
    trace_path,
    trace_prefix,
    write_env,
    write_run_files,
    write_verdict,
)

EVENT = {"i": 0, "kind": "init", "key": "optimizer0", "step": 0, "fp": "aa", "t": []}


def event(i: int, kind: str = "compute", step: int = 0, fp: str = "aa") -> dict[str, Any]:
    return {"i": i, "kind": kind, "key": "optimizer0", "step": step, "fp": fp, "t": []}


def write_events(path: Path, events: list[dict[str, Any]], tail: str = "") -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail, encoding="utf-8")


def _field_strategy(f: dataclasses.Field[Any]) -> st.SearchStrategy[Any]:
    if "bool" in str(f.type):
        return st.none() | st.booleans()
    kind = st.integers() if "int" in str(f.type) else st.text(max_size=10)
    return st.none() | kind


run_settings = st.builds(RunSettings, **{f.name: _field_strategy(f) for f in dataclasses.fields(RunSettings)})


# --- RunSettings ----------------------------------------------------------------------------------


@settings(deadline=None)
@given(run_settings)
def test_settings_round_trip_through_json(s: RunSettings) -> None:
    assert RunSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_settings_to_dict_names_every_field() -> None:
    d = RunSettings(seed=3, PYTHONHASHSEED="12").to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(RunSettings)}
    assert (d["seed"], d["PYTHONHASHSEED"], d["mode"]) == (3, "12", None)


def test_settings_ignore_unknown_keys() -> None:
    assert RunSettings.from_dict({"seed": 3, "from_the_future": [1, 2]}) == RunSettings(seed=3)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("seed", "3"),
        ("seed", True),
        ("seed", 3.0),
        ("seed", None),
        ("seed", [3]),
        ("threads", False),
        ("mode", 1),
        ("mode", ["strict"]),
        ("PYTHONHASHSEED", 12),
        ("run", "0"),
    ],
)
def test_settings_of_the_wrong_type_read_as_unset(key: str, value: object) -> None:
    s = RunSettings.from_dict({key: value, "script": "t.py"})
    assert getattr(s, key) is None
    assert s.script == "t.py"  # the rest is still read


@pytest.mark.parametrize(("key", "value"), [("seed", 3), ("threads", 0), ("mode", "warn"), ("run", 1)])
def test_settings_of_the_right_type_are_read(key: str, value: object) -> None:
    assert getattr(RunSettings.from_dict({key: value}), key) == value


# --- writers and load_run -------------------------------------------------------------------------


def test_written_record_loads_back(tmp_path: Path) -> None:
    settings = RunSettings(seed=7, mode="warn", threads=2, script="t.py", run=1, PYTHONHASHSEED="99")
    write_run_files(tmp_path, ["python", "t.py", "--lr", "1"], settings)
    write_env(tmp_path, {"torch_version": "2.4.0", "num_threads": 4})
    write_events(events_path(tmp_path, 0), [EVENT, event(1)])
    write_events(events_path(tmp_path, 1), [EVENT])
    run = load_run(tmp_path)
    assert run.path == os.fspath(tmp_path)
    assert run.settings == settings and isinstance(run.settings, RunSettings)
    assert run.env == {"torch_version": "2.4.0", "num_threads": 4}
    assert run.events == {0: [EVENT, event(1)], 1: [EVENT]}
    assert run.traces == {}
    command = read_json(tmp_path / COMMAND_FILE)
    assert command == {"argv": ["python", "t.py", "--lr", "1"], "cwd": os.getcwd()}


def test_write_verdict(tmp_path: Path) -> None:
    write_verdict(tmp_path, {"reproducible": True, "runs": 2})
    assert read_json(tmp_path / VERDICT_FILE) == {"reproducible": True, "runs": 2}
    # no temporary file is left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == [VERDICT_FILE]


def test_record_without_settings_or_env(tmp_path: Path) -> None:
    write_events(events_path(tmp_path, 0), [])  # an empty events file is still a record
    run = load_run(tmp_path)
    assert (run.events, run.env, run.settings) == ({0: []}, None, None)


def test_settings_and_env_that_are_not_objects_read_as_none(tmp_path: Path) -> None:
    write_events(events_path(tmp_path, 0), [EVENT])
    (tmp_path / SETTINGS_FILE).write_text("[1, 2]")
    (tmp_path / ENV_FILE).write_text('"text"')
    run = load_run(tmp_path)
    assert (run.settings, run.env) == (None, None)


def test_load_run_of_a_file_or_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(
        EnvFileError, match=re.escape(f"run record not found: '{missing}' is not a directory")
    ):
        load_run(missing)
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    with pytest.raises(EnvFileError, match="is not a directory") as info:
        load_run(a_file)
    assert str(a_file) in str(info.value)
    assert isinstance(info.value, ReproError)


def test_load_run_of_a_directory_without_events(tmp_path: Path) -> None:
    (tmp_path / "events.rank0.json").write_text("")  # a near miss is not an events file
    (tmp_path / "events.rankx.jsonl").write_text("")
    with pytest.raises(EnvFileError, match=re.escape("holds no events.rank<R>.jsonl file")) as info:
        load_run(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("name", [SETTINGS_FILE, ENV_FILE])
@pytest.mark.parametrize("content", [b'{"seed": 3', b"", b"\xff\xfe not utf-8"])
def test_damaged_json_file_names_the_path(tmp_path: Path, name: str, content: bytes) -> None:
    write_events(events_path(tmp_path, 0), [EVENT])
    (tmp_path / name).write_bytes(content)
    with pytest.raises(EnvFileError, match="the run record is damaged") as info:
        load_run(tmp_path)
    assert str(tmp_path / name) in str(info.value)


def test_damaged_events_line_names_the_events_file(tmp_path: Path) -> None:
    path = events_path(tmp_path, 0)
    write_events(path, [EVENT], tail="{not json}\n")
    with pytest.raises(EnvFileError, match="cannot read events file") as info:
        load_run(tmp_path)
    assert str(path) in str(info.value)


# --- traces ---------------------------------------------------------------------------------------


def test_trace_names() -> None:
    prefix = trace_prefix("rec", 3)
    assert prefix.is_absolute() and prefix.name == "trace-step3"
    assert trace_path(prefix, 1) == Path(f"{prefix}.rank1")
    assert trace_path("/x/trace-a", 0) == Path("/x/trace-a.rank0")


def test_load_run_finds_trace_files(tmp_path: Path) -> None:
    write_events(events_path(tmp_path, 0), [EVENT])
    made = {
        (3, 0): trace_path(trace_prefix(tmp_path, 3), 0),
        (3, 1): trace_path(trace_prefix(tmp_path, 3), 1),
        (10, 0): trace_path(trace_prefix(tmp_path, 10), 0),
    }
    for path in made.values():
        path.write_bytes(b"trace")
    for near_miss in ("trace-step3.rank0.json", "trace-stepx.rank0", "trace-step3.rank", "trace-step3"):
        (tmp_path / near_miss).write_bytes(b"not a trace")
    run = load_run(tmp_path)
    found = {
        (step, rank): Path(p).resolve() for step, ranks in run.traces.items() for rank, p in ranks.items()
    }
    assert found == {k: p.resolve() for k, p in made.items()}


# --- events readers -------------------------------------------------------------------------------


def test_read_events_ignores_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "events.rank0.jsonl"
    write_events(path, [event(0), event(1)], tail='{"i": 2, "kind": "comp')
    assert read_events(path) == [event(0), event(1)]
    write_events(path, [event(0)])
    assert read_events(path) == [event(0)]  # a complete last line counts
    path.write_text("")
    assert read_events(path) == []


def test_event_tail_reads_a_growing_file_incrementally(tmp_path: Path) -> None:
    path = tmp_path / "events.rank0.jsonl"
    tail = EventTail(path)
    assert tail.poll() == 0  # not created yet
    write_events(path, [event(0), event(1)])
    assert tail.poll() == 2
    assert tail.poll() == 0
    with open(path, "a", encoding="utf-8") as f:
        text = json.dumps(event(2))
        f.write(text[:5])
        f.flush()
        assert tail.poll() == 0  # half a line is not an event yet
        f.write(text[5:] + "\n" + json.dumps(event(3)) + "\n")
    assert tail.poll() == 2
    assert tail.events == [event(0), event(1), event(2), event(3)]


def test_event_tail_starts_over_when_the_file_shrinks(tmp_path: Path) -> None:
    path = tmp_path / "events.rank0.jsonl"
    write_events(path, [event(0, fp="old"), event(1, fp="old"), event(2, fp="old")])
    tail = EventTail(path)
    assert tail.poll() == 3
    write_events(path, [event(0, fp="new")])  # rewritten, shorter: the process re-executed itself
    assert tail.poll() == 1
    assert tail.events == [event(0, fp="new")]


def test_event_tail_keeps_appending_when_the_file_only_grows(tmp_path: Path) -> None:
    # the counterpart of the test above: without a shrink, nothing already read is dropped
    path = tmp_path / "events.rank0.jsonl"
    write_events(path, [event(0)])
    tail = EventTail(path)
    tail.poll()
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(event(1)) + "\n")
    tail.poll()
    assert tail.events == [event(0), event(1)]


# --- run directories ------------------------------------------------------------------------------


def test_new_run_dir_creates_unique_empty_directories(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    dirs = [new_run_dir(root) for _ in range(20)]
    assert len(set(dirs)) == 20
    assert all(d.is_dir() and d.parent == root and not any(d.iterdir()) for d in dirs)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10))
def test_events_path_names(rank: int) -> None:
    assert events_path("r", rank) == Path("r") / f"events.rank{rank}.jsonl"


# --- malformed input: every complete events line is validated ---------------------------------

GOOD_LEAF = {"fp": "ab", "dtype": "float32", "shape": [2], "v": [1.0, math.nan]}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("[1, 2]", "an event must be a JSON object, got array"),
        ('"text"', "an event must be a JSON object, got string"),
        ("3", "an event must be a JSON object, got number"),
        ("null", "an event must be a JSON object, got null"),
        ("{}", "the event has no 'kind' field"),
        ('{"kind": "init", "key": "k", "step": 0, "fp": "a"}', "the event has no 't' field"),
        ('{"kind": "warmup", "key": "k", "step": 0, "fp": "a", "t": []}', "'kind' must be one of init"),
        ('{"kind": ["init"], "key": "k", "step": 0, "fp": "a", "t": []}', "'kind' must be one of"),
        ('{"kind": "init", "key": 3, "step": 0, "fp": "a", "t": []}', "'key' must be a string"),
        ('{"kind": "init", "key": "k", "step": 0, "fp": null, "t": []}', "'fp' must be a string"),
        ('{"kind": "init", "key": "k", "step": "3", "fp": "a", "t": []}', "'step' must be an integer"),
        ('{"kind": "init", "key": "k", "step": null, "fp": "a", "t": []}', "'step' must be an integer"),
        ('{"kind": "init", "key": "k", "step": true, "fp": "a", "t": []}', "'step' must be an integer"),
        ('{"kind": "init", "key": "k", "step": -1, "fp": "a", "t": []}', "'step' must be an integer"),
        ('{"kind": "init", "key": "k", "step": 1.0, "fp": "a", "t": []}', "'step' must be an integer"),
        ('{"kind": "init", "key": "k", "step": 9223372036854775808, "fp": "a", "t": []}', "2**63-1"),
        ('{"kind": "init", "key": "k", "step": 0, "fp": "a", "t": {}}', "'t' must be an array"),
        ('{"kind": "init", "key": "k", "step": 0, "fp": "a", "t": [3]}', "t[0]: a tensor entry must be"),
        (
            '{"kind": "init", "key": "k", "step": 0, "fp": "a", "t": [{}]}',
            "t[0]: the tensor entry has no 'fp'",
        ),
        (
            '{"kind": "init", "key": "k", "step": 0, "fp": "a", "t": [{"fp": "x", "dtype": 1, "shape": []}]}',
            "t[0]: 'dtype' must be a string",
        ),
        (
            '{"kind": "init", "key": "k", "step": 0, "fp": "a", '
            '"t": [{"fp": "x", "dtype": "f", "shape": [-1]}]}',
            "t[0]: 'shape' must be an array of integers",
        ),
        (
            '{"kind": "init", "key": "k", "step": 0, "fp": "a", '
            '"t": [{"fp": "x", "dtype": "f", "shape": 2}]}',
            "t[0]: 'shape' must be an array of integers",
        ),
        (
            '{"kind": "init", "key": "k", "step": 0, "fp": "a", '
            '"t": [{"fp": "x", "dtype": "f", "shape": [1], "v": ["1"]}]}',
            "t[0]: 'v' must be an array of numbers",
        ),
        (
            '{"kind": "init", "key": "k", "step": 0, "fp": "a", '
            '"t": [{"fp": "x", "dtype": "f", "shape": [1], "v": [true]}]}',
            "t[0]: 'v' must be an array of numbers",
        ),
        (
            '{"kind": "init", "key": "k", "step": 0, "fp": "a", '
            '"t": [{"fp": "x", "dtype": "f", "shape": [1], "v": [1' + "0" * 400 + "]}]}",
            "an integer too large for a float",
        ),
        (
            '{"kind": "init", "key": "\\ud800", "step": 0, "fp": "a", "t": []}',
            "'key' must be a string of Unicode",
        ),
        ("{not json}", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested deeper than"),
        ("1" * 5000, "an integer of 5000 digits"),
    ],
)
def test_a_malformed_events_line_names_the_file_line_and_problem(
    tmp_path: Path, line: str, problem: str
) -> None:
    path = events_path(tmp_path, 0)
    write_events(path, [EVENT, EVENT], tail=line + "\n" + json.dumps(EVENT) + "\n")
    expected = f"cannot read events file {path}, line 3: "
    with pytest.raises(EnvFileError) as info:
        read_events(path)
    message = str(info.value)
    assert message.startswith(expected) and problem in message, message
    assert "\n" not in message and len(message) < 400 + len(str(path))
    with pytest.raises(EnvFileError) as info:  # through load_run: the same error
        load_run(tmp_path)
    assert str(info.value) == message
    tail = EventTail(path)
    with pytest.raises(EnvFileError) as info:  # the live reader: the same error
        tail.poll()
    assert str(info.value) == message
    assert tail.events == [EVENT, EVENT]  # the lines before it were read
    with pytest.raises(EnvFileError, match="line 3"):  # sticky: polling again does not skip it
        tail.poll()


def test_events_that_are_not_utf8_name_the_line(tmp_path: Path) -> None:
    path = events_path(tmp_path, 0)
    path.write_bytes(json.dumps(EVENT).encode() + b"\n" + b'{"kind": "\xff"}\n')
    with pytest.raises(EnvFileError, match=r"line 2: not UTF-8 text"):
        read_events(path)
    with pytest.raises(EnvFileError, match=r"line 2: not UTF-8 text"):
        EventTail(path).poll()


def test_well_formed_events_in_all_their_forms_are_read(tmp_path: Path) -> None:
    # the negative control of the table above: what the recorder writes, and then some
    events = [
        {**EVENT, "kind": kind, "step": step, "t": [GOOD_LEAF, {"fp": "x", "dtype": "int64", "shape": []}]}
        for kind in ("init", "data", "compute", "record")
        for step in (0, 2**63 - 1)
    ]
    events.append(
        {**EVENT, "future_field": [[{"deep": None}]], "t": [{**GOOD_LEAF, "v": [math.inf, 1, -0.0]}]}
    )
    path = events_path(tmp_path, 0)
    write_events(path, events, tail="\n   \n")  # whitespace-only lines are skipped
    got = read_events(path)
    assert len(got) == len(events)
    assert json.dumps(got) == json.dumps(events)  # NaN and infinities in recorded values are kept
    tail = EventTail(path)
    assert tail.poll() == len(events)
    assert json.dumps(tail.events) == json.dumps(events)


def test_event_tail_recovers_when_a_malformed_file_is_rewritten(tmp_path: Path) -> None:
    path = events_path(tmp_path, 0)
    write_events(path, [EVENT], tail='{"kind": "init"}\n')
    tail = EventTail(path)
    with pytest.raises(EnvFileError, match="line 2: the event has no 'key' field"):
        tail.poll()
    path.write_text("")  # the process re-executed itself: the file starts over
    assert tail.poll() == 0
    write_events(path, [EVENT])
    assert tail.poll() == 1 and tail.events == [EVENT]


# --- malformed JSON files -------------------------------------------------------------------------


@pytest.mark.parametrize("name", [SETTINGS_FILE, ENV_FILE])
@pytest.mark.parametrize(
    "content", [b'{"seed": NaN}', b"[" * 5000 + b"]" * 5000, b'{"seed": ' + b"1" * 4400 + b"}"]
)
def test_settings_and_env_that_are_not_strict_json_damage_the_record(
    tmp_path: Path, name: str, content: bytes
) -> None:
    write_events(events_path(tmp_path, 0), [EVENT])
    (tmp_path / name).write_bytes(content)
    with pytest.raises(EnvFileError, match="the run record is damaged") as info:
        load_run(tmp_path)
    assert str(tmp_path / name) in str(info.value) and "\n" not in str(info.value)


def test_varied_workers_round_trip_and_malformed_files_are_refused(tmp_path: Path) -> None:
    assert runrecord.read_varied(tmp_path, 0) is None
    runrecord.write_varied(tmp_path, 1, [(2, 0), (0, 2)])
    assert runrecord.read_varied(tmp_path, 1) == [(2, 0), (0, 2)]
    for bad in ('{"a": 1}', "[[1]]", '[[1, "2"]]', "[[-1, 2]]", "[[true, 2]]"):
        runrecord.varied_path(tmp_path, 2).write_text(bad)
        with pytest.raises(EnvFileError, match=r"varied.rank2.json.*worker counts"):
            runrecord.read_varied(tmp_path, 2)
