"""`torchrepro audit` sees training as `check` does: a step per backward() where no optimizer
steps, and training in the python processes the script starts (each probed in its own process).

Real scripts in real child processes; the scripts that start processes of their own are slow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers import line_of, relative
from torchrepro.cli import main

SCRIPTS = Path(__file__).with_name("audit_scripts")


def _audit(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    main(["audit", "--json", *argv])
    return json.loads(capsys.readouterr().out)


def _codes(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["code"]: f for f in report["findings"]}


def test_a_hand_written_update_loop_is_training(capsys: pytest.CaptureFixture[str]) -> None:
    script = relative(SCRIPTS / "manual_update.py")
    report = _audit(capsys, script)
    assert "TR003" not in _codes(report)
    assert (report["optimizer_steps"], report["backward_steps"], report["training_steps"]) == (0, 1, 1)
    assert report["training_processes"] == 1 and [p["main"] for p in report["processes"]] == [True]
    # control: the same script without backward() is still said to train nothing
    report = _audit(capsys, script, "infer")
    assert "ran no backward()" in _codes(report)["TR003"]["message"]
    assert (report["backward_steps"], report["training_steps"]) == (0, 0)


@pytest.mark.slow
def test_training_in_spawned_children_is_seen_with_its_seeding(capsys: pytest.CaptureFixture[str]) -> None:
    script = SCRIPTS / "spawned.py"
    spawn_line = line_of(script, "mp.spawn(")
    report = _audit(capsys, relative(script))
    found = _codes(report)
    assert "TR003" not in found and "TR208" not in found  # each child seeds itself
    assert (report["optimizer_steps"], report["training_processes"]) == (2, 2)
    children = [p for p in report["processes"] if not p["main"]]
    assert [(c["followed"], c["location"], c["target"], c["optimizer_steps"]) for c in children] == [
        (True, spawn_line, "train", 1)
    ] * 2
    assert {c["start_method"] for c in children} == {"spawn"}
    assert report["ops_recorded"] > 0 and found["TR202"]  # the children's matmuls were recorded
    # control: children that train unseeded are named
    found = _codes(_audit(capsys, relative(script), "unseeded"))
    assert found["TR208"]["message"].startswith(
        f"The 2 child processes started at {spawn_line} (target train)"
    )
    # control: children that train nothing
    report = _audit(capsys, relative(script), "idle")
    assert f"nor did the 2 child processes started at {spawn_line}" in _codes(report)["TR003"]["message"]


def test_a_child_the_audit_could_not_follow_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    script = SCRIPTS / "killed_child.py"
    report = _audit(capsys, relative(script))
    message = _codes(report)["TR003"]["message"]
    assert (
        f"the 1 child process started at {line_of(script, 'child.start()')} (target train) ran outside"
        in message
    )
    assert "inference-only" not in message
    (child,) = [p for p in report["processes"] if not p["main"]]
    assert (child["followed"], child["start_method"]) == (False, "fork")


@pytest.mark.slow
def test_processes_training_one_shared_model_at_once_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    script = SCRIPTS / "hogwild.py"
    start, share = line_of(script, "p.start()  # together"), line_of(script, "model.share_memory()")
    for mode in ("hogwild", "spawn"):
        finding = _codes(_audit(capsys, relative(script), mode))["TR501"]
        assert (finding["severity"], finding["location"]) == ("error", start)
        assert finding["message"].startswith(
            f"The 2 child processes started at {start} (target train) update"
        )
        assert f"Linear `model`, put in shared memory at {share}" in finding["message"], mode
    finding = _codes(_audit(capsys, relative(script), "parent"))["TR501"]
    assert (
        f"The 1 child process started at {start} (target train) and the script's own process"
        in (finding["message"])
    )


@pytest.mark.slow
def test_one_updater_sequential_updaters_and_own_models_are_not_hogwild(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for mode in ("one", "sequential", "own"):
        report = _audit(capsys, relative(SCRIPTS / "hogwild.py"), mode)
        assert "TR501" not in _codes(report), mode
        assert report["training_processes"] == (1 if mode == "one" else 2)
