"""Exact resume for every common training-loop shape, at every checkpoint (issue 12, section 1).

``loop_scripts/loop_shapes.py`` trains 3 epochs of 3 batches in each loop shape (auto-advancing
epochs; ``set_epoch`` with the epoch stored in the checkpoint; code after the inner loop; for/else
with a break; per-step and per-epoch schedulers; gradient accumulation over 2 batches), saves a
checkpoint at every step (after every backward with accumulation, and after the epoch-end code), and resumes
each checkpoint in a new process (forked from a driver that imported torch once, with every RNG
and object scrambled before the load). Every resumed run must end with the uninterrupted run's
bits, with ``num_workers`` 0 and 2. Negative controls show the harness sees the wrong ways to
resume: a plain DataLoader resumed by skipping batches, ``restore_rng=False``, a loader whose
position is not restored, the old "last batch means next epoch" position, and dropped gradients.

Two drivers run side by side (the machine has 2 cores), taking jobs from one queue.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The shared fixture runs ~190 resumes (most of a minute of CPU): more than the default 300 s on a
# machine loaded by other work must not kill it half-way.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPTS = Path(__file__).resolve().parent / "loop_scripts"
SHAPES = ("auto", "set_epoch", "after_loop", "for_else", "sched_step", "sched_epoch", "accum2")
WORKERS = (0, 2)
# Checkpoints per shape: 9 steps of 3 batches, plus 3 after the epoch-end code; for/else breaks
# out before its 9th step (so its third epoch has no epoch end); accum2 saves after every backward.
# Three batches an epoch are enough for every position: the first, one in the middle, the last
# (partial) one; an odd count, so accum2's windows cross epochs.
EXPECTED_CHECKPOINTS = {
    "auto": 9,
    "set_epoch": 9,
    "after_loop": 12,
    "for_else": 10,
    "sched_step": 9,
    "sched_epoch": 12,
    "accum2": 9,
}
BATCHES_PER_EPOCH = 3
NEGATIVE = {
    "plain_dataloader": {"shape": "auto", "workers": 0, "loader": "plain"},
    "no_rng": {"shape": "auto", "workers": 0, "mode": "no_rng"},
    "fresh_loader": {"shape": "after_loop", "workers": 0, "mode": "fresh_loader"},
    "old_finished": {"shape": "sched_epoch", "workers": 0, "mode": "old_finished"},
    "drop_grads": {"shape": "accum2", "workers": 0, "mode": "drop_grads"},
}

Key = tuple[str, ...]


def key_of(job: dict[str, Any]) -> Key:
    return (job["shape"], str(job["workers"]), job.get("loader", "seeded"), job.get("mode", "exact"))


class Driver:
    """One ``loop_shapes.py drive`` process: a job line in, a result line out."""

    def __init__(self, log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "loop_shapes.py"), "drive"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def ask(self, job: dict[str, Any], directory: Path) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"job": job, "dir": str(directory)}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            return {"error": f"driver died (exit {self.proc.wait()}), see {self.log.name}"}
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


def run_jobs(
    jobs: list[dict[str, Any]], directory: Path, logs: Path, parallel: int = 2
) -> dict[Key, dict[str, Any]]:
    todo: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    for item in enumerate(jobs):
        todo.put(item)
    results: dict[Key, dict[str, Any]] = {}

    def serve(driver: Driver) -> None:
        while True:
            try:
                i, job = todo.get_nowait()
            except queue.Empty:
                return
            results[key_of(job)] = driver.ask(job, directory / f"job{i:02d}")

    drivers = [Driver(logs / f"driver{n}.log") for n in range(parallel)]
    try:
        threads = [threading.Thread(target=serve, args=(driver,)) for driver in drivers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
    finally:
        for driver in drivers:
            driver.close()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Key, dict[str, Any]]]:
    exact = [{"shape": shape, "workers": workers} for workers in (2, 0) for shape in SHAPES]
    # Checkpoints in memory (tmpfs) where there is one: ~190 saves, each fsynced.
    shm = Path("/dev/shm")
    on_shm = shm.is_dir() and os.access(shm, os.W_OK)
    logs = tmp_path_factory.mktemp("loops")
    directory = Path(tempfile.mkdtemp(prefix="torchrepro-loops-", dir=shm)) if on_shm else logs
    try:
        # The slowest jobs (workers start every epoch) first, so the two queues end together.
        found = run_jobs(exact + list(NEGATIVE.values()), directory, logs)
        (logs / "results.json").write_text(json.dumps({"-".join(k): v for k, v in found.items()}, indent=1))
        yield found
    finally:
        if on_shm:
            shutil.rmtree(directory, ignore_errors=True)


def describe(label: dict[str, Any]) -> str:
    return (
        f"checkpoint {label['file']} ({label['where']} loop, epoch {label['epoch']}, "
        f"batch {label['in_epoch']}, step {label['step']}, backward {label['micro']})"
    )


def outcomes(result: dict[str, Any]) -> list[tuple[dict[str, Any], str | None, list[str]]]:
    """(label, the resumed run's crash or None, how its final state differs) for each checkpoint."""
    assert result.get("error") is None, result.get("error")
    pairs = zip(result["checkpoints"], result["results"], strict=True)
    return [(label, r["error"], r["differences"] or []) for label, r in pairs]


@pytest.mark.parametrize("workers", WORKERS, ids=lambda w: f"num_workers={w}")
def test_every_checkpoint_of_every_loop_shape_resumes_exactly(
    results: dict[Key, dict[str, Any]], workers: int
) -> None:
    failures, counts = [], {}
    for shape in SHAPES:
        result = results[(shape, str(workers), "seeded", "exact")]
        if result.get("error") is not None:
            failures.append(f"{shape}: {result['error']}")
            continue
        counts[shape] = len(result["checkpoints"])
        failures += [
            f"{shape}: {describe(label)}: {error or '; '.join(diffs)}"
            for label, error, diffs in outcomes(result)
            if error or diffs
        ]
    assert not failures, f"{len(failures)} resumes differ from the uninterrupted run:\n" + "\n".join(failures)
    assert counts == EXPECTED_CHECKPOINTS


def test_num_workers_does_not_change_the_uninterrupted_run(results: dict[Key, dict[str, Any]]) -> None:
    digests = {
        shape: {results[(shape, str(w), "seeded", "exact")].get("digest") for w in WORKERS}
        for shape in SHAPES
    }
    assert all(len(d) == 1 and None not in d for d in digests.values()), digests


def differing(
    name: str, results: dict[Key, dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The checkpoints a negative control resumed differently, and all of them."""
    found = outcomes(results[key_of(NEGATIVE[name])])
    crashed = [f"{describe(label)}: {error}" for label, error, _ in found if error]
    assert not crashed, crashed  # they must differ, not fail
    return [label for label, _, diffs in found if diffs], [label for label, _, _ in found]


def test_a_plain_dataloader_resumed_by_skipping_batches_differs(results: dict[Key, dict[str, Any]]) -> None:
    differ, everything = differing("plain_dataloader", results)
    mid_epoch = [c for c in everything if 0 < c["in_epoch"] < BATCHES_PER_EPOCH]
    # Its order comes from the global RNG at iter(): re-iterating draws another one.
    assert all(c in differ for c in mid_epoch), [describe(c) for c in mid_epoch if c not in differ]


def test_resuming_without_the_rng_state_differs(results: dict[Key, dict[str, Any]]) -> None:
    differ, everything = differing("no_rng", results)
    # Dropout draws from torch's RNG at every step: every checkpoint with a step left differs.
    assert differ == everything[:-1]


def test_replaying_the_epoch_from_its_first_batch_differs(results: dict[Key, dict[str, Any]]) -> None:
    # set_epoch(e) on a loader whose position was not restored (what set_epoch after
    # load_state_dict did before issue 12): only the checkpoints at an epoch's start are exact.
    differ, everything = differing("fresh_loader", results)
    assert differ == [c for c in everything if c["where"] == "inner"]


def test_jumping_to_the_next_epoch_at_the_last_batch_differs(results: dict[Key, dict[str, Any]]) -> None:
    # A checkpoint at an epoch's last batch resumed at the next epoch (before issue 12): the
    # epoch-end code (validation, shrink-and-perturb, scheduler.step()) of that epoch is skipped.
    differ, everything = differing("old_finished", results)
    at_last_batch = [c for c in everything if c["where"] == "inner" and c["in_epoch"] == BATCHES_PER_EPOCH]
    assert len(at_last_batch) == 3
    assert differ == at_last_batch


def test_dropping_the_accumulated_gradients_differs(results: dict[Key, dict[str, Any]]) -> None:
    # Gradients not restored (before issue 12): exactly the checkpoints in the middle of a window.
    differ, everything = differing("drop_grads", results)
    assert differ == [c for c in everything if c["micro"] % 2 == 1]


def test_a_loader_built_before_the_process_group_shards_by_the_rank_at_pass_start(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "rank_at_pass_start.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["early_w0"] == rank["early_w2"] == rank["explicit"]
        assert rank["states"]["early_w0"] == rank["states"]["explicit"]
    assert len(ranks[0]["early_w0"]) == len(ranks[1]["early_w0"]) == 6
    assert sorted(ranks[0]["early_w0"] + ranks[1]["early_w0"]) == list(range(12))  # disjoint, all
