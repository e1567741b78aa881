"""End-to-end: ``torchrepro check`` names the op, module and source line where two runs part.

Each script is copied into a fresh directory and checked from there (so ``location`` is relative),
in real subprocesses (torchrun with gloo for the 2-rank case). Each case is its own negative
control: the divergence is real (check exits 1), and the test asserts that the op, module and line
the tool names are those of the one line that makes the runs differ, not a victim downstream.
The four checks run concurrently to keep the wall time down.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).parent / "locate_scripts"
CASES: dict[str, tuple[str, ...]] = {
    "dropout_urandom": (),
    "pid_factor": (),
    "custom_backward_noise": (),
    "ddp_rank1": ("--nproc", "2"),
}


def _line(script: Path, marker: str) -> int:
    for number, text in enumerate(script.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# locate: {marker}"):
            return number
    raise AssertionError(f"{script.name} has no line marked {marker!r}")


def _start_check(directory: Path, name: str, *extra: str) -> subprocess.Popen[str]:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(SCRIPTS / f"{name}.py", directory / f"{name}.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHREPRO_")}
    return subprocess.Popen(
        [sys.executable, "-m", "torchrepro", "check", "--json", *extra, f"{name}.py"],
        cwd=directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, dict[str, Any], str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"check timed out:\n{err[-3000:]}") from None
    lines = out.strip().splitlines()
    assert len(lines) == 1, f"stdout must be exactly one JSON object:\n{out}\n{err[-3000:]}"
    return proc.returncode, json.loads(lines[0]), err


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, dict[str, Any], str]]:
    root = tmp_path_factory.mktemp("locate")
    procs = {name: _start_check(root / name, name, *extra) for name, extra in CASES.items()}
    return {name: _finish(proc) for name, proc in procs.items()}


def _divergence(verdicts: dict[str, tuple[int, dict[str, Any], str]], name: str) -> dict[str, Any]:
    code, verdict, err = verdicts[name]
    assert (code, verdict["reproducible"]) == (1, False), err[-3000:]
    first: dict[str, Any] = verdict["first_divergence"]
    assert first["kind"] == "compute", first
    return first


def test_dropout_reseeded_from_urandom_is_located_at_the_dropout_call(
    verdicts: dict[str, tuple[int, dict[str, Any], str]],
) -> None:
    first = _divergence(verdicts, "dropout_urandom")
    assert first["step"] == 2
    assert "bernoulli" in first["op"] or "dropout" in first["op"], first
    script = SCRIPTS / "dropout_urandom.py"
    assert (first["module"], first["location"]) == ("drop", f"dropout_urandom.py:{_line(script, 'dropout')}")


def test_pid_dependent_factor_is_located_at_the_mul_in_its_layer(
    verdicts: dict[str, tuple[int, dict[str, Any], str]],
) -> None:
    first = _divergence(verdicts, "pid_factor")
    assert (first["step"], first["op"]) == (0, "aten.mul.Tensor")
    script = SCRIPTS / "pid_factor.py"
    # model = Sequential(Linear, Sequential(Tanh, Scale), Linear): the Scale layer is "1.1".
    assert (first["module"], first["location"]) == ("1.1", f"pid_factor.py:{_line(script, 'pid mul')}")


def test_noise_added_only_in_a_custom_backward_is_located_at_the_backward_line(
    verdicts: dict[str, tuple[int, dict[str, Any], str]],
) -> None:
    first = _divergence(verdicts, "custom_backward_noise")
    assert first["step"] == 0
    assert first["op"].startswith("aten.add."), first
    script = SCRIPTS / "custom_backward_noise.py"
    expected = f"custom_backward_noise.py:{_line(script, 'noisy backward')}"
    # The Function is applied in Net.forward itself, so its module is the root ("Net").
    assert (first["module"], first["location"]) == ("Net", expected)


def test_two_rank_run_where_only_rank_1_diverges_names_rank_1(
    verdicts: dict[str, tuple[int, dict[str, Any], str]],
) -> None:
    code, verdict, err = verdicts["ddp_rank1"]
    assert (code, verdict["reproducible"]) == (1, False), err[-3000:]
    first = verdict["first_divergence"]
    script = SCRIPTS / "ddp_rank1.py"
    expected = {
        "step": 0,
        "rank": 1,
        "kind": "compute",
        "op": "aten.mul.Tensor",
        "module": "1",  # DDP's "module." prefix is dropped: Sequential(Linear, Wobble, Linear)[1]
        "location": f"ddp_rank1.py:{_line(script, 'rank 1 mul')}",
    }
    assert first == expected, err[-3000:]
