"""``_child.teardown``: the ranks of a run end their gloo process group together.

Two real processes in a gloo world: rank 1 reaches the end 1.5 s after rank 0. With the teardown
installed, rank 0's ``destroy_process_group()`` (or ``finish()``, for a group the script left
alive) returns only once rank 1 has arrived; stock, it returns at once (the negative control):
that early teardown is what let gloo abort a rank whose last collective was still in flight.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port, user_env

WORKER = """
import json, os, sys, time
import torch.distributed as dist
rank, port, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
from torchrepro._child import teardown
if how != "stock":
    teardown.install()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
dist.all_reduce(__import__("torch").ones(1))
if rank == 1:
    time.sleep(1.5)
start = time.monotonic()
if how == "finish":
    teardown.finish()
else:
    dist.destroy_process_group()
print(json.dumps({"rank": rank, "waited": time.monotonic() - start, "alive": dist.is_initialized()}))
"""


def _world(tmp_path: Path, how: str) -> dict[int, dict[str, float]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port, how],
            env=user_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    out = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-2000:]
        result = json.loads(stdout.strip().splitlines()[-1])
        out[result["rank"]] = result
    return out


@pytest.mark.parametrize("how", ["destroy", "finish"])
def test_rank_0_ends_its_group_only_once_rank_1_has_arrived(tmp_path: Path, how: str) -> None:
    ended = _world(tmp_path, how)
    assert ended[0]["waited"] > 1.0  # it waited for rank 1's 1.5 s
    assert ended[1]["waited"] < 1.0
    assert not ended[0]["alive"] and not ended[1]["alive"]


def test_stock_destroy_does_not_wait(tmp_path: Path) -> None:
    ended = _world(tmp_path, "stock")  # negative control
    assert ended[0]["waited"] < 1.0


ENDING = """
import atexit, os, sys, threading, time
import torch
import torch.distributed as dist
def main(rank=None, port=None):
  if rank is None:
    dist.init_process_group("gloo")
  else:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
  rank = dist.get_rank()
  model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
  model(torch.ones(2, 3)).sum().backward()  # the reducer holds the group until finalization
  atexit.register(lambda: open(f"atexit.{rank}", "w").write("ran"))
  global left_open
  left_open = open(f"open.{rank}", "w")
  left_open.write("flushed")  # buffered, never closed by the script
  def late():
    time.sleep(0.5)
    open(f"thread.{rank}", "w").write("joined")
  threading.Thread(target=late).start()
  dist.destroy_process_group()
if __name__ == "__main__":
  if "--spawn" in sys.argv:
    import torch.multiprocessing as mp
    mp.spawn(main, args=(int(sys.argv[2]),), nprocs=2)
  else:
    main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", ["torchrun", "mp.spawn"])
def test_a_rank_that_ended_a_world_exits_as_a_normal_exit_would_for_the_script(
    tmp_path: Path, ranks: str
) -> None:
    """After the world ended, the process skips only the interpreter's finalization (where gloo can
    abort): its threads are joined, its atexit functions run, the files it left open are flushed;
    for ranks torchrepro starts (``--nproc``) and ranks the script spawns itself alike."""
    (tmp_path / "ending.py").write_text(ENDING, encoding="utf-8")
    how = ["--nproc", "2", "ending.py"] if ranks == "torchrun" else ["ending.py", "--spawn", str(free_port())]
    proc = subprocess.run(
        [sys.executable, "-m", "torchrepro", "run", *how],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"atexit.{rank}").read_text() == "ran"
        assert (tmp_path / f"open.{rank}").read_text() == "flushed"
        assert (tmp_path / f"thread.{rank}").read_text() == "joined"
