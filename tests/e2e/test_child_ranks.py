"""Ranks a script starts itself, checked with ``torchrepro check`` (real processes, real ranks).

Three ways a script starts its own ranks: ``torch.multiprocessing.spawn`` (gloo, 2 ranks),
Lightning's ``strategy="ddp"`` (rank 1 is a new ``python script.py``), and a ``subprocess`` of
``sys.executable`` with ``RANK=1``. Each is reproducible with both ranks compared; the negative
control draws unseeded noise on rank 1 only, and must be reported as a divergence on rank 1
(before, rank 1 was unrecorded: the check passed, or blamed rank 0, or compared nothing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import check_json as check
from helpers import torchrepro, user_env
from torchrepro.compare import compare_runs, first_divergence
from torchrepro.runrecord import load_run

SCRIPTS = Path(__file__).resolve().parent / "child_scripts"

STARTERS = ["mp_spawn.py", "lightning_ddp.py", "subprocess_parent.py"]


def _trained(verdict: dict[str, Any], rank: int) -> int:
    return int(verdict["coverage"]["per_rank"].get(str(rank), {}).get("compute", 0))


@pytest.mark.parametrize("script", STARTERS)
def test_script_started_ranks_are_seeded_recorded_and_compared(tmp_path: Path, script: str) -> None:
    code, verdict, err = check(tmp_path, str(SCRIPTS / script))
    assert code == 0, (verdict, err)
    assert verdict["reproducible"] is True
    assert _trained(verdict, 0) == 3 and _trained(verdict, 1) == 3, verdict["coverage"]
    assert verdict["coverage"]["uncovered_ranks"] == []


@pytest.mark.parametrize("script", STARTERS)
def test_unseeded_randomness_on_a_script_started_rank_is_reported_on_that_rank(
    tmp_path: Path, script: str
) -> None:
    code, verdict, err = check(tmp_path, str(SCRIPTS / script), "--noisy")
    assert code == 1, (verdict, err)
    assert verdict["reproducible"] is False
    first = verdict["first_divergence"]
    assert (first["rank"], first["kind"], first["step"]) == (1, "data", 0), first


def test_compare_names_the_event_check_names(tmp_path: Path) -> None:
    """Two complete recorded runs of the noisy mp.spawn script: rank 1's batch differs, and the
    all-reduced gradients carry it into rank 0's optimizer step 0. ``compare`` names rank 1's batch,
    as ``check`` does above (one ordering rule, ``events.divergence_order``); it used to name rank
    0's optimizer step (it ordered by step, then rank)."""
    for name in ("a", "b"):
        proc = torchrepro(tmp_path, "run", "--record", name, str(SCRIPTS / "mp_spawn.py"), "--noisy")
        assert proc.returncode == 0, proc.stderr
    first = compare_runs(tmp_path / "a", tmp_path / "b").first_divergence
    assert first is not None and (first.rank, first.kind, first.step) == (1, "data", 0), first
    # the control: rank 0 parts at the same step too, in its optimizer step, which the old
    # (step, rank) order put first
    a, b = load_run(tmp_path / "a"), load_run(tmp_path / "b")
    rank0 = first_divergence(a.events[0], b.events[0], rank=0)
    assert rank0 is not None and (rank0.kind, rank0.step) == ("compute", 0), rank0


def test_a_child_without_a_rank_of_its_own_makes_the_check_inconclusive(tmp_path: Path) -> None:
    code, verdict, err = check(tmp_path, str(SCRIPTS / "subprocess_parent.py"), "--no-rank")
    assert code == 3, (verdict, err)
    assert verdict["inconclusive"] is True and verdict["first_divergence"] is None
    notes = "\n".join(verdict["notes"])
    assert "subprocess_rank.py --no-rank` was not recorded" in notes, notes
    assert "no RANK or LOCAL_RANK of its own" in notes


def test_a_forked_rank_is_never_a_pass(tmp_path: Path) -> None:
    """A rank forked from rank 0 cannot be configured or recorded: inconclusive, naming it; with
    unseeded noise on it, the all-reduced gradients part on rank 0 (the negative control)."""
    code, verdict, err = check(tmp_path, str(SCRIPTS / "fork_rank.py"))
    assert code == 3, (verdict, err)
    assert verdict["inconclusive"] is True and verdict["coverage"]["uncovered_ranks"] == [1]
    assert _trained(verdict, 0) == 3
    notes = "\n".join(verdict["notes"])
    assert "rank 1 (started by the script) wrote no record in run(s) 1, 2" in notes, notes
    assert "was compared on rank(s) 1 (training was compared on rank(s) 0)" in notes, notes
    # the forked rank trained: it says so itself (it inherited the hooks, not the recorder)
    assert "fork_rank.py` was not recorded: it was forked from a process of the run and trained" in notes
    code, verdict, err = check(tmp_path, str(SCRIPTS / "fork_rank.py"), "--noisy")
    assert code == 1, (verdict, err)
    first = verdict["first_divergence"]
    assert (first["rank"], first["kind"], first["step"], first["name"]) == (0, "compute", 0, "grad:0.weight")


def test_spawned_dataloader_workers_are_left_to_torch(tmp_path: Path) -> None:
    """Spawn-method DataLoader workers are python children of the run: they are not configured
    (no strict switches, no record, no uncovered note); torch seeds them from the seeded main."""
    env = user_env()
    outputs = []
    for name in ("a", "b"):
        proc = subprocess.run(
            [sys.executable, "-m", "torchrepro", "run", "--record", name, str(SCRIPTS / "spawn_workers.py")],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        names = sorted(p.name for p in (tmp_path / name).iterdir())
        assert not [n for n in names if n.startswith(("uncovered", "world", "events.rank1"))], names
    a, b = outputs
    assert a["main_strict"] is True  # the script's own process is configured ...
    assert [row[0] for row in a["rows"]] == [0.0] * 4  # ... its spawned workers are not
    assert a["rows"] == b["rows"]  # and torch's own worker seeding makes them reproducible
