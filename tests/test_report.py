"""report: distances per step from hand-made records, the page's content, where it may be written.

The page in a real browser, from a real check: tests/cli/test_report_browser.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from torchrepro.compare import compare_runs
from torchrepro.errors import SettingsError
from torchrepro.report import (
    GENERATOR,
    check_report_path,
    compare_report_data,
    distance_series,
    render_report,
    source_excerpt,
    write_compare_report,
)
from torchrepro.runrecord import COMMAND_FILE, events_path

Event = dict[str, Any]


def leaf(
    name: str, values: list[float] | None = None, *, sample: list[float] | None = None
) -> dict[str, Any]:
    fp = json.dumps([values, sample])
    entry: dict[str, Any] = {"fp": fp, "dtype": "float32", "shape": [len(values or [0] * 100)], "n": name}
    if values is not None:
        entry["v"] = values
    if sample is not None:
        entry["s"] = sample
    return entry


def event(i: int, kind: str, key: str, step: int, tensors: list[dict[str, Any]]) -> Event:
    return {
        "i": i,
        "kind": kind,
        "key": key,
        "step": step,
        "fp": json.dumps([t["fp"] for t in tensors]),
        "t": tensors,
    }


def run(steps: int, deltas: dict[int, float], *, extra: list[Event] | None = None) -> list[Event]:
    """init, then per step a batch and an update of ``param:w`` (4 values) and ``param:big`` (a large
    tensor: only a sample); ``deltas[step]`` is added to the first value of both from that step on."""
    events = [event(0, "init", "optimizer0", 0, [leaf("param:w", [0.0] * 4)])]
    offset = 0.0
    for step in range(steps):
        offset = deltas.get(step, offset)
        events.append(event(len(events), "data", "loader0", step, [leaf("[0]", [float(step)])]))
        w = leaf("param:w", [1.0 + offset, 2.0, 3.0, 4.0])
        big = leaf("param:big", sample=[0.5 + offset, 0.0])
        events.append(event(len(events), "compute", "optimizer0", step, [w, big]))
    return events + (extra or [])


def record(path: Path, ranks: dict[int, list[Event]]) -> Path:
    path.mkdir(parents=True)
    for rank, events in ranks.items():
        events_path(path, rank).write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    return path


def test_every_step_gets_a_point_and_the_difference_grows(tmp_path: Path) -> None:
    a = record(tmp_path / "a", {0: run(6, {})})
    b = record(tmp_path / "b", {0: run(6, {2: 1e-7, 3: 1e-5, 4: 1e-3})})
    series = distance_series(a, b, label="b vs a")
    assert [p.step for p in series.points] == [0, 1, 2, 3, 4, 5]
    assert [p.differing for p in series.points] == [0, 0, 2, 2, 2, 2]
    assert [p.tensors for p in series.points] == [4, 3, 3, 3, 3, 3]  # init joins step 0
    largest = [p.largest for p in series.points]
    assert largest[:2] == [None, None]
    assert (
        largest[2] == pytest.approx(1e-7) and largest[4] == pytest.approx(1e-3) and largest[5] == largest[4]
    )
    # the large tensor's difference is from its sample: a lower bound, so the step is not exact
    assert not series.points[2].exact and series.points[2].first == "parameter w"
    assert series.parted is None and series.final is None


def test_a_step_whose_sample_is_equal_is_drawn_as_differing_without_a_value(tmp_path: Path) -> None:
    a_events, b_events = run(2, {}), run(2, {})
    b_events[-1] = event(
        4, "compute", "optimizer0", 1, [leaf("param:w", [1.0, 2.0, 3.0, 4.0]), leaf("param:big")]
    )
    a_events[-1] = event(
        4,
        "compute",
        "optimizer0",
        1,
        [leaf("param:w", [1.0, 2.0, 3.0, 4.0]), leaf("param:big", sample=[1.0])],
    )
    series = distance_series(record(tmp_path / "a", {0: a_events}), record(tmp_path / "b", {0: b_events}))
    last = series.points[-1]
    assert (last.differing, last.largest, last.exact) == (1, None, False)


def test_runs_that_do_different_things_are_plotted_up_to_there(tmp_path: Path) -> None:
    a_events, b_events = run(5, {}), run(5, {})
    b_events[5] = {**b_events[5], "key": "loader1"}  # step 2's batch comes from another loader
    series = distance_series(record(tmp_path / "a", {0: a_events}), record(tmp_path / "b", {0: b_events}))
    assert series.parted == 2 and [p.step for p in series.points] == [0, 1]


def test_a_run_stopped_earlier_is_not_a_run_that_parted(tmp_path: Path) -> None:
    series = distance_series(record(tmp_path / "a", {0: run(5, {})}), record(tmp_path / "b", {0: run(3, {})}))
    assert series.parted is None and [p.step for p in series.points] == [0, 1, 2]


def test_ranks_are_added_up_per_step_and_the_final_state_is_apart(tmp_path: Path) -> None:
    final = [event(99, "compute", "final", 0, [leaf("final:model.w", [1.0])])]
    final_b = [event(99, "compute", "final", 0, [leaf("final:model.w", [2.0])])]
    a = record(tmp_path / "a", {0: run(3, {}, extra=final), 1: run(3, {}, extra=final)})
    b = record(tmp_path / "b", {0: run(3, {1: 1e-6}, extra=final_b), 1: run(3, {2: 1e-2}, extra=final)})
    series = distance_series(a, b)
    assert [p.differing for p in series.points] == [0, 2, 4]
    assert series.points[2].largest == pytest.approx(1e-2)
    assert series.final is not None and series.final.differing == 1 and series.final.largest == 1.0


def test_records_of_different_world_sizes_compare_rank_0_in_invariant_events(tmp_path: Path) -> None:
    a = record(tmp_path / "a", {0: run(3, {})})
    b_events = run(3, {})
    for e in b_events:
        if e["kind"] == "data":  # batches depend on the split: not compared across world sizes
            e["fp"], e["t"] = "other", [leaf("[0]", [-1.0])]
    b = record(tmp_path / "b", {0: b_events, 1: run(3, {})})
    assert [p.differing for p in distance_series(a, b).points] == [0, 0, 0]


def test_the_page_is_self_contained_and_escapes_what_it_shows(tmp_path: Path) -> None:
    evil = "</script><script>alert(1)</script><img src=http://example.com/x.png>"
    a = record(tmp_path / "a", {0: run(4, {})})
    b = record(tmp_path / "b", {0: run(4, {1: 1e-4})})
    for path in (a, b):
        (path / COMMAND_FILE).write_text(
            json.dumps({"argv": ["python", "t.py", evil], "cwd": "/"}), encoding="utf-8"
        )
    result = compare_runs(a, b)
    data = compare_report_data(result, a, b)
    page = render_report(data)
    assert page.startswith("<!DOCTYPE html>") and f'content="{GENERATOR}"' in page
    assert evil not in page and "alert(1)</script>" not in page
    assert "<script>" not in page  # nothing runs; the data block is JSON only
    scripts = re.findall(r"<script[^>]*>", page)
    assert scripts == ['<script type="application/json" id="torchrepro-data">']
    # nothing is loaded from anywhere: no element or style refers to anything
    tags = re.findall(r"<[a-zA-Z][^<>]*>", page)
    assert not [t for t in tags if re.match(r"<(?:img|link|iframe|object|embed|audio|video|source)\b", t)]
    assert not [t for t in tags if re.search(r"\b(?:src|href)\s*=", t)]
    assert "url(" not in page and "@import" not in page
    assert len(re.findall(r'<circle class="point', page)) == 4
    embedded = re.search(r'id="torchrepro-data">(.*?)</script>', page, re.S)
    assert embedded is not None
    payload = json.loads(embedded.group(1))
    assert payload["status"] == "not identical" and payload["verdict"]["first_divergence"]["step"] == 1
    assert [p["differing"] for p in payload["series"][0]["points"]] == [0, 2, 2, 2]


def test_the_source_around_the_named_line(tmp_path: Path) -> None:
    src = tmp_path / "train.py"
    src.write_text("".join(f"line {i}\n" for i in range(1, 31)), encoding="utf-8")
    excerpt = source_excerpt("train.py:12", str(tmp_path))
    assert excerpt is not None and (excerpt.line, excerpt.first) == (12, 7)
    assert excerpt.lines == tuple(f"line {i}" for i in range(7, 18))
    assert source_excerpt(f"{src}:1", None).lines[0] == "line 1"  # type: ignore[union-attr]
    for missing in ("train.py:99", "nofile.py:3", "train.py", None, "train.py:x"):
        assert source_excerpt(missing, str(tmp_path)) is None


def test_a_report_is_never_written_over_a_file_that_is_not_one(tmp_path: Path) -> None:
    a = record(tmp_path / "a", {0: run(2, {})})
    b = record(tmp_path / "b", {0: run(2, {})})
    result = compare_runs(a, b)
    with pytest.raises(SettingsError, match="is a directory"):
        check_report_path(tmp_path)
    with pytest.raises(SettingsError, match="does not exist"):
        check_report_path(tmp_path / "no" / "r.html")
    mine = tmp_path / "notes.html"
    mine.write_text("<html>my notes</html>", encoding="utf-8")
    with pytest.raises(SettingsError, match="not a torchrepro report"):
        write_compare_report(mine, result, a, b)
    assert mine.read_text(encoding="utf-8") == "<html>my notes</html>"
    out = write_compare_report(tmp_path / "r.html", result, a, b)
    assert "IDENTICAL" in out.read_text(encoding="utf-8")
    assert write_compare_report(out, result, a, b) == out  # an earlier report may be replaced


def test_the_command_line_refuses_a_report_path_before_it_runs_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchrepro import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('the script must not run')\n", encoding="utf-8")
    mine = tmp_path / "mine.html"
    mine.write_text("<p>mine</p>", encoding="utf-8")
    for report, why in [
        (".", "is a directory"),
        ("no/r.html", "does not exist"),
        ("mine.html", "not a torchrepro report"),
    ]:
        assert cli.main(["check", "--report", report, "train.py"]) == 2
        assert why in capsys.readouterr().err
        assert cli.main(["compare", "--json", "--report", report, "a", "b"]) == 2
        assert why in json.loads(capsys.readouterr().out)["error"]["message"]
    assert mine.read_text(encoding="utf-8") == "<p>mine</p>"
    assert not (tmp_path / ".torchrepro").exists()  # no check started


def test_a_restarted_run_is_plotted_from_the_step_it_resumed_at_with_the_kill_marked(tmp_path: Path) -> None:
    from torchrepro.report.distances import record_series, resumed_record
    from torchrepro.report.svg import distance_svg
    from torchrepro.runrecord import load_run

    first = load_run(record(tmp_path / "a", {0: run(6, {})}))
    # the restart resumed at step 3 (counting its steps from 0), read one extra batch first, and
    # its step 4 (its own 1) differs
    own = run(6, {4: 1e-3})
    restart = [own[0], event(1, "data", "loader0", 0, [leaf("[0]", [9.0])])]
    for e in own[1 + 2 * 3 :]:
        restart.append({**e, "step": e["step"] - 3 if e["kind"] == "compute" else e["step"]})
    stitched = resumed_record(first, load_run(record(tmp_path / "b", {0: restart})), 3)
    series = record_series(first, stitched, label="resumed vs a")
    assert [p.step for p in series.points] == [0, 1, 2, 3, 4, 5]
    assert [p.differing for p in series.points] == [0, 0, 0, 0, 2, 2]
    assert series.parted is None
    svg = distance_svg([series], [(4, "killed after step 4"), (3, "resumed at step 3")])
    assert svg.count('class="mark"') == 4 and 'data-step="3"' in svg and "killed after step 4" in svg
