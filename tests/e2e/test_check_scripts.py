"""End-to-end: ``torchrepro check`` on real scripts, in real subprocesses (torchrun with gloo).

Every "reproducible" verdict is paired with a negative control in which the same script, run as
plain python would (``--no-seed``) or with one irrelevant setting varied, is caught diverging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def check(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[int, dict[str, Any], str]:
    """Run ``torchrepro check --json`` in ``tmp_path``; return (exit code, verdict, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHREPRO_")}
    env.pop("PYTHONHASHSEED", None)  # --no-seed must see what plain python sees
    proc = subprocess.run(
        [sys.executable, "-m", "torchrepro", "check", "--json", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be exactly one JSON object:\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, json.loads(lines[0]), proc.stderr


def script(name: str) -> str:
    return str(SCRIPTS / name)


def test_unseeded_script_is_reproducible_under_check_and_not_without_seeding(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("unseeded.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    assert verdict == {
        "reproducible": True,
        "runs": 2,
        "steps_compared": 4,
        "first_divergence": None,
        "inconclusive": False,
        "coverage": {
            "per_kind": {"compute": 4, "data": 4, "init": 1},
            "per_rank": {"0": {"compute": 4, "data": 4, "init": 1}},
            "uncovered_ranks": [],
        },
        "notes": [],
    }

    code, verdict, err = check(tmp_path, "--no-seed", script("unseeded.py"))
    assert (code, verdict["reproducible"]) == (1, False), err
    assert verdict["first_divergence"] == {
        "step": 0,
        "rank": 0,
        "kind": "init",
        "op": None,
        "module": None,
        "location": None,
    }


def test_vary_workers_exposes_worker_randomness_in_a_plain_dataloader(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("worker_random.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    code, verdict, err = check(tmp_path, "--vary", "workers", script("worker_random.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "data"
    assert verdict["first_divergence"]["step"] == 0
    assert "--vary workers: num_workers 2 -> 0 in 1 DataLoader (run 2)" in verdict["notes"]


def test_vary_workers_that_varies_nothing_is_inconclusive(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("no_loader.py"))
    assert (code, verdict["reproducible"]) == (0, True), err  # the control: a plain check passes
    code, verdict, err = check(tmp_path, "--vary", "workers", script("no_loader.py"))
    assert (code, verdict["reproducible"], verdict["inconclusive"]) == (3, None, True), err
    assert "--vary workers: run 2 created no DataLoader; nothing was varied" in verdict["notes"]


def test_vary_workers_survives_a_loader_rebuilt_by_accelerate(tmp_path: Path) -> None:
    """accelerator.prepare rebuilds the loader from the varied one: the variation must stay."""
    code, verdict, err = check(tmp_path, script("worker_random_accelerate.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    code, verdict, err = check(tmp_path, "--vary", "workers", script("worker_random_accelerate.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "data"


def test_urandom_reseed_before_step_5_is_a_compute_divergence_at_step_5(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, "--no-locate", "--runs", "3", script("urandom_reseed.py"))
    assert code == 1, err
    assert verdict["runs"] == 3
    assert verdict["first_divergence"]["kind"] == "compute"
    assert verdict["first_divergence"]["step"] == 5
    assert verdict["steps_compared"] == 6


def test_unseeded_numpy_generator_in_a_dataset_is_a_data_divergence_at_step_0(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("numpy_generator.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "data"
    assert verdict["first_divergence"]["step"] == 0
    assert verdict["steps_compared"] == 0


def test_set_ordered_vocabulary_is_reproducible_and_exposed_by_vary_hashseed(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("vocab_set.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    code, verdict, err = check(tmp_path, "--vary", "hashseed", script("vocab_set.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "data"
    assert verdict["first_divergence"]["step"] == 0


def test_two_rank_ddp_is_reproducible_with_nproc_2(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, "--nproc", "2", script("ddp_train.py"))
    assert (code, verdict["reproducible"]) == (0, True), err
    assert verdict["steps_compared"] == 4
    checks = list((tmp_path / ".torchrepro" / "checks").iterdir())
    assert sorted(p.name for p in (checks[0] / "run0").glob("events.rank*.jsonl")) == [
        "events.rank0.jsonl",
        "events.rank1.jsonl",
    ]
    # negative control: the same launch without seeding differs from the start
    code, verdict, err = check(tmp_path, "--nproc", "2", "--no-seed", script("ddp_train.py"))
    assert code == 1, err
    assert verdict["first_divergence"]["kind"] == "init"


def test_a_script_that_raises_is_exit_2_with_its_traceback_never_a_divergence(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, script("crash.py"))
    assert code == 2
    assert verdict["reproducible"] is None and verdict["first_divergence"] is None
    assert "ValueError: boom at step 1" in err
    assert 'crash.py", line 12' in err
    assert "bootstrap.py" not in err  # the traceback is the script's, as python shows it


def test_a_missing_script_is_exit_2_naming_it(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torchrepro", "check", "--json", "no_such_train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "no_such_train.py" in proc.stderr
    assert not (tmp_path / ".torchrepro").exists()


@pytest.mark.parametrize("n", [1])
def test_steps_stops_every_run_after_n_optimizer_steps_also_serially(tmp_path: Path, n: int) -> None:
    code, verdict, err = check(tmp_path, "--serial", "--steps", str(n), script("unseeded.py"))
    assert (code, verdict["steps_compared"]) == (0, n), err


def test_nothing_compared_is_inconclusive_never_reproducible(tmp_path: Path) -> None:
    """A hand-written update loop records no step: exit 3 and the coverage, not "reproducible"."""
    code, verdict, err = check(tmp_path, script("manual_sgd.py"))
    assert code == 3, err
    assert verdict["reproducible"] is None and verdict["inconclusive"] is True
    assert verdict["steps_compared"] == 0 and verdict["coverage"]["uncovered_ranks"] == [0]
    assert any(note.startswith("inconclusive:") for note in verdict["notes"])
    # the weights really differ between runs that draw different seeds: a pass would be false
    code, verdict, err = check(tmp_path, script("manual_sgd.py"), "--unseeded")
    assert code == 3 and verdict["reproducible"] is None, err
    # control: the same loop through torch.optim is compared step by step and passes
    code, verdict, err = check(tmp_path, script("manual_sgd.py"), "--optim")
    assert (code, verdict["reproducible"], verdict["inconclusive"]) == (0, True, False), err
    assert verdict["coverage"]["per_kind"] == {"compute": 5, "init": 1}
