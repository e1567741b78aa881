"""``torchrepro run --trace-step K`` + ``torchrepro compare``: name the op, module and line where runs part.

Four real runs, started together to keep the wall time down, of one small CNN whose dropout is
re-seeded from ``os.urandom`` before step 2 (``--reseed-at 2``) or not:
A, B (``torchrepro run``): re-seeded, traced at step 2 -> compare names the dropout op, its module
and its line. C, D (the library's ``launch``): not re-seeded; C traced at step 1, D untraced ->
identical (exit 0): the negative control, which also shows that tracing changes no numerics.
D vs A: diverges at step 2, D holds no trace -> op null and a hint; C vs A: traces of another step
-> op null and a note saying so. The comparisons run in-process through the CLI's ``main``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from helpers import marked_line, user_env
from torchrepro.cli import main
from torchrepro.launch import launch

SCRIPT = Path(__file__).parent / "scripts" / "dropout_reseed.py"


def _line(marker: str) -> int:
    return marked_line(SCRIPT, f"locate: {marker}")


def _compare(capsys: pytest.CaptureFixture[str], a: Path, b: Path, *flags: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["compare", os.fspath(a), os.fspath(b), *flags])
    return code, capsys.readouterr().out


def _compare_json(capsys: pytest.CaptureFixture[str], a: Path, b: Path) -> tuple[int, dict[str, Any]]:
    code, out = _compare(capsys, a, b, "--json")
    lines = out.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON object:\n{out}"
    return code, json.loads(lines[0])


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("traced_runs")
    shutil.copy(SCRIPT, root / SCRIPT.name)  # run from its directory: locations are relative
    env = user_env()
    cli = [sys.executable, "-m", "torchrepro", "run", "--trace-step", "2", "--record"]
    procs = {
        name: subprocess.Popen(
            [*cli, name, SCRIPT.name, "--reseed-at", "2"],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("A", "B")
    }
    codes: dict[str, int] = {}

    def library_run(name: str, trace_step: int | None) -> None:
        result = launch(os.fspath(root / SCRIPT.name), record_dir=root / name, trace_step=trace_step)
        codes[name] = result.returncode

    threads = [threading.Thread(target=library_run, args=a) for a in (("C", 1), ("D", None))]
    for t in threads:
        t.start()
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"run {name} failed:\n{err[-3000:]}"
    for t in threads:
        t.join(timeout=300)
    assert codes == {"C": 0, "D": 0}
    return root


def test_traced_runs_record_their_trace_and_settings(records: Path) -> None:
    assert sorted(p.name for p in (records / "A").glob("trace-*")) == ["trace-step2.rank0"]
    assert sorted(p.name for p in (records / "C").glob("trace-*")) == ["trace-step1.rank0"]
    assert not list((records / "D").glob("trace-*"))
    assert json.loads((records / "A" / "settings.json").read_text())["trace_step"] == 2
    assert json.loads((records / "C" / "settings.json").read_text())["trace_step"] == 1
    assert json.loads((records / "D" / "settings.json").read_text())["trace_step"] is None


def test_compare_of_traced_runs_names_op_module_and_line(
    records: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, verdict = _compare_json(capsys, records / "A", records / "B")
    assert (code, verdict["reproducible"]) == (1, False), verdict
    first = verdict["first_divergence"]
    assert (first["kind"], first["step"], first["rank"]) == ("compute", 2, 0), first
    assert "bernoulli" in first["op"] or "dropout" in first["op"], first
    assert first["module"] == "drop"
    assert first["location"] == f"{SCRIPT.name}:{_line('dropout')}"
    assert any("random number generator" in note for note in verdict["notes"]), verdict["notes"]
    code, human = _compare(capsys, records / "A", records / "B")
    assert code == 1 and f"module drop, location {SCRIPT.name}:{_line('dropout')}" in human, human


def test_negative_control_identical_runs_and_runs_without_traces(
    records: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # no re-seed: identical, although C was traced (at step 1) and D was not
    code, verdict = _compare_json(capsys, records / "C", records / "D")
    assert (code, verdict["reproducible"], verdict["first_divergence"]) == (0, True, None), verdict
    assert verdict["steps_compared"] == 4
    # D holds no trace: the divergence is found, the op is not, and the report says how to get it
    code, verdict = _compare_json(capsys, records / "D", records / "A")
    first = verdict["first_divergence"]
    assert (code, first["kind"], first["step"]) == (1, "compute", 2), verdict
    assert (first["op"], first["module"], first["location"]) == (None, None, None)
    assert any("--trace-step 2" in note for note in verdict["notes"]), verdict["notes"]
    # traces of another step than the divergent one: op stays null, and the note says which step
    code, verdict = _compare_json(capsys, records / "C", records / "A")
    first = verdict["first_divergence"]
    assert (code, first["kind"], first["step"], first["op"]) == (1, "compute", 2, None), verdict
    assert any("step(s) 1, not of step 2" in note for note in verdict["notes"]), verdict["notes"]
    code, human = _compare(capsys, records / "C", records / "A")
    assert code == 1 and "not of step 2" in human, human


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_launch_rejects_a_bad_trace_step(bad: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="integer >= 0"):
        launch(str(SCRIPT), trace_step=bad, record_dir=tmp_path / "rec")
    assert not (tmp_path / "rec").exists()  # rejected before anything was written


@pytest.mark.parametrize("bad", ["-1", "x", "1.5"])
def test_cli_trace_step_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--trace-step", bad, str(SCRIPT)]) == 2
    assert "--trace-step" in capsys.readouterr().err


def test_a_threads_difference_is_called_a_setting_not_nondeterminism(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LayerNorm's backward splits a reduction by the thread count: records of --threads 1 and
    --threads 2, both traced at step 0, part there. compare names the op and says the thread
    count decides its result, not that the op is nondeterministic; the environment variables
    --threads set are put under that setting, and what every two records differ in is left out."""
    script = Path(__file__).parents[1] / "e2e" / "scripts" / "threads_layernorm.py"
    cli = [sys.executable, "-m", "torchrepro", "run", "--trace-step", "0", "--record"]
    procs = [
        subprocess.Popen(
            [*cli, name, "--threads", threads, os.fspath(script)],
            cwd=tmp_path,
            env=user_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, threads in (("one", "1"), ("two", "2"))
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    code, verdict = _compare_json(capsys, tmp_path / "one", tmp_path / "two")
    assert code == 1 and verdict["first_divergence"]["op"] == "aten.native_layer_norm_backward.default"
    assert verdict["notes"][0].startswith("started with different threads: 1 vs 2 (a settings difference")
    source = next(n for n in verdict["notes"] if n.startswith("source op"))
    assert "between 1 thread (run A) and 2 threads (run B): the op's result depends on that setting" in source
    assert "nondeterministic" not in source
    code, human = _compare(capsys, tmp_path / "one", tmp_path / "two")
    assert code == 1
    assert "env set by the threads setting above: " in human and "OMP_NUM_THREADS" in human
    assert " ! env" not in human  # every environment difference here is the setting's
    assert "collected_at" not in human and "RECORD_DIR" not in human
    assert os.fspath(tmp_path) not in human  # no record path at all in this report
