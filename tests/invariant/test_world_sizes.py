"""The same bits for every world size: real processes, real torchrun with gloo (1 thread per rank).

A CNN with dropout and BatchNorm, an augmenting dataset, momentum SGD and Adam, global batches
of V = 12 micro-batches of 2 samples (tests/invariant/scripts/train.py). Final weights, buffers
and optimizer state are compared for W in {1, 2, 3, 4} with num_workers 0 and 2; the run is
resumed, in a new process, from the checkpoint after every optimizer step of a 2-process run onto
1, 3 and 4 processes. Negative controls: stock DDP with DistributedSampler and accumulation, the
same loop without keyed forwards, and a plain sum instead of the tree all differ across W. The
controls, the Adam runs and the runs with 2 workers share the launches of the SGD runs of their W
(``--also``: each from the global RNG state a fresh process has): one launch per W, which saves
twelve launches' start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "train.py"
SRC = str(Path(__file__).resolve().parents[2] / "src")
CHECKPOINTS = ["step-1.pt", "step-2.pt", "step-3.pt", "step-4.pt"]  # 2 epochs x 2 global batches

pytestmark = pytest.mark.slow


def launch(out: Path, world: int, *args: str) -> dict[str, Any]:
    """Train with ``world`` processes (a plain process without a process group for 1). Several
    ranks start through ``torchrepro run --mode off`` (torchrun, gloo; the script's own switches),
    which ends them once torch's gloo workers are idle: plain torchrun may abort a rank at exit
    (``_child/teardown.py``)."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    if world == 1:
        cmd = [sys.executable, str(SCRIPT)]
    else:
        record = out.with_name(out.stem + "-record")
        cmd = [sys.executable, "-m", "torchrepro", "run", "--mode", "off", "--record", str(record)]
        cmd += ["--nproc", str(world), str(SCRIPT)]
    proc = subprocess.run(
        [*cmd, str(out), *args], capture_output=True, text=True, env=env, timeout=300, cwd=out.parent
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[Any, ...], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("worlds")
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    controls = "ddp,nokey,plainsum"  # run in the launches of W = 1 and 2 after their own run
    also = {1: f"workers,{controls},adam", 2: f"workers,{controls}", 3: "workers,adam", 4: "workers"}
    out["sgd", 2, 0] = launch(tmp / "w2.json", 2, "--save", str(ckpt), "--also", also[2])
    with ThreadPoolExecutor(max_workers=2) as pool:  # the resumes two at a time: they only read ckpt
        resumed = {
            w: pool.submit(launch, tmp / f"w{w}.json", w, "--resume", str(ckpt), "--also", also[w])
            for w in (1, 3, 4)
        }
        for world, future in resumed.items():
            out["sgd", world, 0] = future.result()
    for world, names in also.items():
        for name in names.split(","):
            key = {"adam": ("adam", world, 0), "workers": ("sgd", world, 2)}.get(name, (name, world, 0))
            out[key] = {"final": out["sgd", world, 0]["also"][name]}
    assert sorted(p.name for p in ckpt.glob("step-*.pt")) == CHECKPOINTS
    return out


def test_every_world_size_and_worker_count_ends_with_the_same_bits(runs: dict) -> None:
    finals = {key: run["final"] for key, run in runs.items() if key[0] == "sgd"}
    assert len(finals) == 8  # W in {1, 2, 3, 4} x num_workers in {0, 2}
    for (_, world, _workers), ranks in finals.items():
        assert len(ranks) == world
    assert len({fp for ranks in finals.values() for fp in ranks}) == 1, finals


def test_adam_state_is_the_same_bits_on_1_and_3_processes(runs: dict) -> None:
    one, three = runs["adam", 1, 0]["final"], runs["adam", 3, 0]["final"]
    assert len(set(one + three)) == 1
    assert one != runs["sgd", 1, 0]["final"]  # Adam's state is compared, not SGD's again


def test_resume_at_every_checkpoint_onto_another_world_size_ends_with_the_uninterrupted_bits(
    runs: dict,
) -> None:
    uninterrupted = runs["sgd", 2, 0]["final"][0]
    for world in (1, 3, 4):
        resumed = runs["sgd", world, 0]["resumed"]
        assert sorted(resumed) == CHECKPOINTS
        for name, ranks in resumed.items():
            assert ranks == [uninterrupted] * world, (world, name)


@pytest.mark.parametrize("mode", ["ddp", "nokey", "plainsum"])
def test_negative_controls_differ_across_world_sizes(runs: dict, mode: str) -> None:
    """Stock DDP + DistributedSampler + accumulation; the same loop with dropout drawn from the
    global stream; the micro-batch gradients summed rank by rank and all-reduced: each gives
    other bits on 1 and 2 processes, where InvariantDataParallel gives the same."""
    one, two = runs[mode, 1, 0]["final"], runs[mode, 2, 0]["final"]
    assert one[0] not in two
    assert runs["sgd", 1, 0]["final"] == runs["sgd", 2, 0]["final"][:1]
