"""SeededLoader resumed in fresh processes equals the uninterrupted run, without loading skipped samples.

One uninterrupted run, and a chain of fresh processes that each load the saved position, consume
some batches and save it again: mid-epoch, at the epoch boundary, twice in one epoch, in a later
epoch, with num_workers and persistent workers changing between segments. Negative control: a plain
DataLoader resumed the usual way (seed_everything, re-iterate, throw batches away) differs, and
loads the samples it skips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parent / "data_scripts" / "resume_segment.py"
N, BATCH = 38, 4  # 10 batches per epoch, the last one of 2 samples


def start(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen[str], Path]:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out


def finish(proc: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def chain(tmp_path: Path, segments: list[tuple[str, ...]]) -> list[dict[str, Any]]:
    results, state = [], tmp_path / "state.json"
    for i, args in enumerate(segments):
        state_in = ("--state-in", str(state)) if i else ()
        proc, out = start(tmp_path, f"segment{i}", *args, *state_in, "--state-out", str(state))
        results.append(finish(proc, out))
    return results


def test_resume_in_fresh_processes_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    full = start(tmp_path, "full", "--num-workers", "2")
    # Negative control, alongside: a plain DataLoader resumed the usual way at epoch 1, batch 3.
    plain_state = tmp_path / "plain-state.json"
    plain_state.write_text(json.dumps({"epoch": 1, "batches_consumed": 3}))
    plain_full = start(tmp_path, "plain-full", "--plain")
    plain_resumed = start(tmp_path, "plain-resumed", "--plain", "--state-in", str(plain_state))
    segments = [
        ("--stop", "0", "3"),  # mid-epoch
        ("--stop", "0", "10", "--num-workers", "2", "--prefetch-factor", "1"),  # at the boundary
        ("--stop", "1", "6"),  # mid-epoch in a later epoch
        ("--num-workers", "2", "--prefetch-factor", "1", "--persistent"),  # to the end
    ]
    results = chain(tmp_path, segments)
    reference = finish(*full)

    resumed = [b for r in results for b in r["batches"]]
    assert len(reference["batches"]) == 30
    assert resumed == reference["batches"]
    positions = [(r["state"]["epoch"], r["state"]["batches_consumed"]) for r in results]
    assert positions == [(0, 3), (0, 10), (1, 6), (2, 10)]
    # No skipped sample is loaded: every segment loads exactly the samples it delivers (the last
    # batch of an epoch has 2 samples), where loading the skipped ones would add 12 or 24.
    assert [r["loads"] for r in results] == [3 * BATCH, N - 3 * BATCH, 6 * BATCH, (N - 6 * BATCH) + N]

    plain, plain_reference = finish(*plain_resumed), finish(*plain_full)
    assert len(plain["batches"]) == 17 and len(plain_reference["batches"]) == 30
    assert [b[:2] for b in plain["batches"]] == [b[:2] for b in plain_reference["batches"][13:]]
    assert plain["batches"] != plain_reference["batches"][13:]  # the resumed run differs
    assert plain["loads"] == 2 * N  # and it loaded the 3 skipped batches again
