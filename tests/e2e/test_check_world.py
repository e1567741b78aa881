"""``torchrepro check --vary world`` and ``--nproc 2`` on training split across processes, in real
processes (torchrun with gloo, 1 thread per rank).

One small script (``world_scripts/global_batch.py``) trains on global batches of 4 micro-batches:
with ``torchrepro.InvariantDataParallel`` (the same bits on 1 and 2 processes), with stock DDP,
``DistributedSampler`` and gradient accumulation (the negative control: its gradients depend on how
the global batch is split), or not at all; and under FSDP2, invariant (its sharded tensors are
recorded whole, so 1 and 2 processes compare) and stock (the negative control). Each check runs
once (a module fixture, two at a time); their run records are reused for ``torchrepro compare``
(in this process: it reads the records).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from helpers import torchrepro_here, user_env
from torchrepro.runrecord import SETTINGS_FILE

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).resolve().parent / "world_scripts" / "global_batch.py")

CHECKS: dict[str, tuple[str, ...]] = {
    "invariant": ("--vary", "world", SCRIPT),
    "ddp": ("--vary", "world", SCRIPT, "--mode", "ddp"),
    "none": ("--vary", "world", SCRIPT, "--mode", "none"),
    "nproc2": ("--nproc", "2", SCRIPT),
    "fsdp": ("--vary", "world", SCRIPT, "--mode", "fsdp"),
    "fsdp_stock": ("--vary", "world", SCRIPT, "--mode", "fsdp-stock"),
}

COMPARED = {"init": 1, "compute": 3, "final": 1}  # per rank: no batch, backward() step or record
WORLD = {
    "processes": [1, 2],
    "reference_rank": 0,
    "compared": ["init", "compute", "final"],
    "not_compared": ["data", "record", "backward"],
}


class Checked:
    """A check's exit code, verdict, stderr and run records."""

    def __init__(self, directory: Path, args: tuple[str, ...]) -> None:
        directory.mkdir(parents=True)
        proc = subprocess.run(
            [sys.executable, "-m", "torchrepro", "check", "--json", *args],
            cwd=directory,
            env=user_env(drop=("PYTHONHASHSEED", "OMP_NUM_THREADS")),
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1, f"stdout must be exactly one JSON object:\n{proc.stdout}\n{proc.stderr}"
        self.code = proc.returncode
        self.verdict: dict[str, Any] = json.loads(lines[0])
        self.stderr = proc.stderr
        self.directory = directory
        (check_dir,) = (directory / ".torchrepro" / "checks").iterdir()
        self.runs = sorted(check_dir.glob("run[0-9]"))

    def settings(self, run: int) -> dict[str, Any]:
        return dict(json.loads((self.runs[run] / SETTINGS_FILE).read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checked]:
    root = tmp_path_factory.mktemp("world")
    with ThreadPoolExecutor(max_workers=2) as pool:  # the machine is small: two checks at a time
        futures = {name: pool.submit(Checked, root / name, args) for name, args in CHECKS.items()}
        return {name: future.result() for name, future in futures.items()}


def test_invariant_data_parallel_is_the_same_on_1_and_2_processes(checked: dict[str, Checked]) -> None:
    c = checked["invariant"]
    assert (c.code, c.verdict["reproducible"]) == (0, True), c.stderr[-3000:]
    assert c.verdict["first_divergence"] is None and c.verdict["varied"] == "1 vs 2 processes"
    assert c.verdict["steps_per_optimizer"] == {"optimizer0": 3}
    # rank 0 of the run on 1 process against both ranks of the run on 2, in optimizer steps only
    assert c.verdict["coverage"] == {
        "per_kind": {"compute": 6, "final": 2, "init": 2},
        "per_rank": {"0": COMPARED, "1": COMPARED},
        "uncovered_ranks": [],
    }
    assert c.verdict["world"] == WORLD
    assert any("run 1 on 1 process, the other run(s) on 2 processes" in n for n in c.verdict["notes"])
    # how the runs were started: 1 and 2 processes, the same single thread per process
    assert [c.settings(i)["nproc"] for i in range(2)] == [1, 2]
    assert [c.settings(i)["threads"] for i in range(2)] == [1, 1]
    events = [sorted(p.name for p in run.glob("events.rank*.jsonl")) for run in c.runs]
    assert events == [["events.rank0.jsonl"], ["events.rank0.jsonl", "events.rank1.jsonl"]]


def test_ddp_with_accumulation_differs_between_1_and_2_processes_at_step_0(
    checked: dict[str, Checked],
) -> None:
    c = checked["ddp"]
    assert (c.code, c.verdict["reproducible"]) == (1, False), c.stderr[-3000:]
    first = c.verdict["first_divergence"]
    assert (first["kind"], first["step"], first["key"]) == ("compute", 0, "optimizer0"), first
    assert first["name"].startswith("grad:"), first  # the gradients already differ
    assert c.verdict["reason"].startswith(
        "the parameters after optimizer step 0 differ between 1 and 2 processes"
    )
    assert "depend on how the global batch is split" in c.verdict["reason"]
    assert "torchrepro.InvariantDataParallel" in c.verdict["reason"]
    assert first["op"] is None  # op traces of different splits are not compared op by op
    assert c.verdict["world"] == WORLD


def test_a_script_that_trains_nothing_is_inconclusive_across_world_sizes(checked: dict[str, Checked]) -> None:
    c = checked["none"]
    assert (c.code, c.verdict["reproducible"], c.verdict["inconclusive"]) == (3, None, True), c.stderr[-3000:]
    assert c.verdict["reason"].startswith("no optimizer step was compared on any rank")
    assert c.verdict["coverage"]["per_kind"] == {"final": 2}  # its batches were not compared


def test_nproc_2_check_of_invariant_data_parallel_compares_every_event_of_both_ranks(
    checked: dict[str, Checked],
) -> None:
    c = checked["nproc2"]
    assert (c.code, c.verdict["reproducible"]) == (0, True), c.stderr[-3000:]
    both = {"compute": 3, "data": 6, "final": 1, "init": 1}  # each rank's 6 micro-batches too
    assert c.verdict["coverage"]["per_rank"] == {"0": both, "1": both}
    assert "world" not in c.verdict


def test_compare_of_the_records_across_world_sizes_and_at_one(
    checked: dict[str, Checked], capsys: pytest.CaptureFixture[str]
) -> None:
    one, two = checked["invariant"].runs
    code, out, err = torchrepro_here(capsys, "compare", "--json", str(one), str(two))
    assert code == 0, out + err
    result = json.loads(out)
    assert result["reproducible"] is True and result["world"] == WORLD
    assert result["coverage"]["per_rank"] == {"0": COMPARED, "1": COMPARED}
    assert "started with different nproc: 1 vs 2" in result["notes"]
    # the DDP control's records part at step 0 in compare too, saying why
    one, two = checked["ddp"].runs
    code, out, err = torchrepro_here(capsys, "compare", str(one), str(two))
    assert code == 1, out + err
    assert "NOT identical: first divergence: compute at step 0" in out
    assert "depend on how the global batch is split" in out
    # two records on 2 processes each: rank by rank, every event
    a, b = checked["nproc2"].runs
    code, out, err = torchrepro_here(capsys, "compare", "--json", str(a), str(b))
    assert code == 0, out + err
    assert json.loads(out)["coverage"]["per_kind"]["data"] == 12


def test_fsdp2_under_invariant_data_parallel_is_the_same_on_1_and_2_processes(
    checked: dict[str, Checked],
) -> None:
    c = checked["fsdp"]
    assert c.code == 0 and c.verdict["reproducible"] is True, c.stderr[-3000:]
    assert c.verdict["coverage"]["per_kind"]["compute"] >= 3, c.verdict


def test_stock_fsdp2_with_accumulation_differs_between_1_and_2_processes(checked: dict[str, Checked]) -> None:
    c = checked["fsdp_stock"]
    assert c.code == 1 and c.verdict["reproducible"] is False, c.stderr[-3000:]
    assert c.verdict["first_divergence"]["kind"] == "compute", c.verdict
