"""``_child.teardown``: a process reaches the interpreter's exit only once its gloo workers are idle.

Two real processes in a gloo world. Rank 0 starts an ``all_reduce`` that rank 1 joins later:
meanwhile rank 0's gloo worker is busy (the negative control: ``quiesce`` with a short timeout gives
up and says so), and ``quiesce`` returns only once the worker has finished the collective and let go
of its work. The end-to-end cases (the abort at exit, files left open) are in ``tests/e2e/test_exit.py``.
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port, user_env
from torchrepro._child import teardown

WORKER = """
import json, os, sys, time
import torch
import torch.distributed as dist
from torchrepro._child import teardown
teardown.install()  # as in a run: rank 1 leaves right after its collective (pytorch#190489 at exit)
rank, port, started = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
dist.all_reduce(torch.ones(1))
deadline = time.monotonic() + 10
while len(teardown.gloo_workers()) < 2 and time.monotonic() < deadline:  # a thread names itself
    time.sleep(0.01)  # when it first runs: under load the second may not have run yet
out = {"rank": rank, "workers": len(teardown.gloo_workers()), "idle_before": teardown.quiesce(timeout=5)}
if rank == 1:
    while not os.path.exists(started):  # rank 0 started its collective and gave up waiting once
        time.sleep(0.01)
    time.sleep(0.5)
    out["joined"] = time.time()
    dist.all_reduce(torch.ones(3))
else:
    dist.all_reduce(torch.ones(3), async_op=True)  # the handle dropped: only the worker holds it
    out["gave_up"] = not teardown.quiesce(timeout=0.3)
    open(started, "w").close()
    out["idle"] = teardown.quiesce()
    out["returned"] = time.time()
print(json.dumps(out))
"""


def test_quiesce_returns_once_the_gloo_worker_let_go_of_a_late_collective(tmp_path: Path) -> None:
    """Rank 1 joins rank 0's collective only after rank 0's short ``quiesce`` gave up (a file says
    when): ``quiesce`` returns after rank 1 joined, whatever the machine's load."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    port, started = str(free_port()), str(tmp_path / "started")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port, started],
            env=user_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results, errors = {}, {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-2000:]
        result = json.loads(stdout.strip().splitlines()[-1])
        results[result["rank"]], errors[result["rank"]] = result, stderr
    assert results[0]["workers"] == results[1]["workers"] == 2  # ProcessGroupGloo's worker threads
    assert results[0]["idle_before"] and results[1]["idle_before"]
    assert results[0]["gave_up"]  # busy while rank 1 had not joined
    assert "a gloo worker thread was still busy 0.3 s after the script ended" in errors[0]
    assert results[0]["idle"]
    assert results[0]["returned"] > results[1]["joined"], results  # not before the peer joined


QUIET = """
import json, time
from torchrepro._child import teardown
start = time.monotonic()
workers, idle = teardown.gloo_workers(), teardown.quiesce()
print(json.dumps({"workers": workers, "idle": idle, "seconds": time.monotonic() - start}))
"""


def test_quiesce_returns_at_once_without_gloo_workers() -> None:
    """In a fresh interpreter: this one may hold the worker threads of a gloo group an earlier
    test made (a DeviceMesh keeps its group alive after destroy_process_group)."""
    proc = subprocess.run(
        [sys.executable, "-c", QUIET], capture_output=True, text=True, env=user_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["workers"] == [] and result["idle"] is True
    assert result["seconds"] < 0.5


def test_install_registers_quiesce_once(monkeypatch: pytest.MonkeyPatch) -> None:
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setitem(teardown._installed, "quiesce", False)
    teardown.install()
    teardown.install()
    assert registered == [teardown.quiesce]
