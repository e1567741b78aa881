"""``torchrepro check`` across nodes: two checks on this machine, each in its own working directory
with nothing shared but the endpoint, stand for two nodes.

Shared launches: a check of a DDP script that is reproducible (``--steady``) and one of the same
script whose rank 1, on the other node, is not (the negative control: the same harness must catch
it and name its rank, op and line). A node killed mid-check (either node) and a node alone are
launches of their own, all four at once: most of their time is waiting for a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from helpers import free_port, marked_line, processes_with, user_env

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
WOBBLE = HERE / "node_scripts" / "rank1_wobble.py"
PROC = os.path.isdir("/proc")  # processes_with lists the processes left running through it


def _check(port: int, node_rank: int | None, *args: str, timeout: int = 120) -> list[str]:
    rank = [] if node_rank is None else ["--node-rank", str(node_rank)]
    return [
        sys.executable, "-m", "torchrepro", "check", "--json", "--nnodes", "2", *rank,
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--join-timeout", str(timeout), *args,
    ]  # fmt: skip


def start_checks(
    root: Path,
    name: str,
    *args: str,
    ranks: tuple[int | None, ...] = (None, None),
    threads: tuple[int, int] = (1, 1),
) -> tuple[list[Path], list[subprocess.Popen[str]]]:
    """Start the check on two 'nodes', each in its own directory under ``root / name``, with
    ``threads`` OpenMP threads each."""
    port = free_port()
    dirs = [root / name / f"node{i}" for i in range(2)]
    procs = []
    for d, rank, n in zip(dirs, ranks, threads, strict=True):
        d.mkdir(parents=True)
        procs.append(
            subprocess.Popen(
                _check(port, rank, *args),
                cwd=d,
                env=user_env(OMP_NUM_THREADS=str(n)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return dirs, procs


def finish(dirs: list[Path], procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    out = []
    for d, p in zip(dirs, procs, strict=True):
        stdout, stderr = p.communicate(timeout=300)
        lines = stdout.strip().splitlines()
        assert len(lines) == 1, stdout + stderr[-4000:]
        out.append({"dir": d, "code": p.returncode, "verdict": json.loads(lines[0]), "stderr": stderr})
    return out


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("check_nodes")
    return {  # the steady check's nodes run with other thread counts: the verdict names the node
        "steady": finish(*start_checks(root, "steady", str(WOBBLE), "--steady", threads=(1, 2))),
        "wobble": finish(*start_checks(root, "wobble", str(WOBBLE))),
    }


def _leader(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    (leader,) = [n for n in nodes if "this node ran its ranks of every run" not in n["stderr"]]
    return leader


def test_a_reproducible_ddp_script_passes_on_every_node(checks: dict[str, list[dict[str, Any]]]) -> None:
    nodes = checks["steady"]
    for node in nodes:
        assert node["code"] == 0, node["stderr"][-4000:]
        assert node["verdict"]["reproducible"] is True
        assert sorted(node["verdict"]["coverage"]["per_rank"]) == ["0", "1"]  # both nodes' ranks compared
        assert all(c["compute"] == 3 for c in node["verdict"]["coverage"]["per_rank"].values())
    leader = _leader(nodes)
    (follower,) = [n for n in nodes if n is not leader]
    assert follower["verdict"]["coverage"] == leader["verdict"]["coverage"]
    # every rank's records are on the leader: rank 1's events came from the other node
    check_dir = _records(leader)
    for run in ("run0", "run1"):
        assert (check_dir / run / "events.rank1.jsonl").exists()
        assert (check_dir / run / "env.node1.json").exists()
        world = json.loads((check_dir / run / "world.rank1.json").read_text())
        assert (world["world_size"], world["node"]) == (2, 1)
    assert (
        f"the verdict and every rank's records are on node 0 (host {os.uname().nodename})"
        in follower["stderr"]
    )
    # the nodes run with 1 and 2 threads: not a divergence of this script, but the verdict says it
    (other,) = [n for n in leader["verdict"]["notes"] if "runs in another environment than node 0" in n]
    assert "node 1 (host " in other and "num_threads" in other, other
    # the follower wrote nothing into its working directory but its own check records
    assert sorted(p.name for p in follower["dir"].iterdir()) == [".torchrepro"]


def _records(node: dict[str, Any]) -> Path:
    line = next(x for x in node["stderr"].splitlines() if x.startswith("torchrepro check: records in "))
    return node["dir"] / line.split("records in ", 1)[1].split(":")[-1]


def test_a_rank_1_nondeterminism_on_the_other_node_is_caught_and_located(
    checks: dict[str, list[dict[str, Any]]],
) -> None:
    line = marked_line(WOBBLE, "nodes: rank 1 mul")
    for node in checks["wobble"]:
        assert node["code"] == 1, node["stderr"][-4000:]
        first = node["verdict"]["first_divergence"]
        assert (first["rank"], first["step"], first["op"]) == (1, 0, "aten.mul.Tensor"), first
        assert first["location"].endswith(f"rank1_wobble.py:{line}")
        assert f"rank 1 ran on node 1 (host {os.uname().nodename})" in node["verdict"]["notes"]
    leader = _leader(checks["wobble"])
    # located from rank 1's op trace, which the other node wrote and forwarded
    assert list(_records(leader).glob("locate*/trace-b.rank1"))


def kill_mid_check(root: Path, killed: int) -> tuple[int, dict[str, Any], str, list[int]]:
    """A check on two nodes whose node ``killed`` dies by SIGKILL once both ranks have joined: the
    survivor's exit code, verdict and stderr, and what still runs with the check's token."""
    token = f"torchrepro-check-kill-{os.getpid()}-{killed}"
    dirs, procs = start_checks(root, "kill", str(WOBBLE), "--steady", "--sleep", "0.2", token, ranks=(0, 1))
    deadline = time.monotonic() + 120
    while not all(list(d.glob(".torchrepro/checks/*/run*/world.rank*.json")) for d in dirs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
            p.communicate() for p in procs
        ]
        time.sleep(0.2)
    procs[killed].send_signal(signal.SIGKILL)  # that node's check dies: its machine went away
    survivor = procs[1 - killed]
    stdout, stderr = survivor.communicate(timeout=120)
    procs[killed].communicate(timeout=30)
    deadline = time.monotonic() + 30
    while processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    return survivor.returncode, json.loads(stdout.strip().splitlines()[-1]), stderr, processes_with(token)


def alone(root: Path, node_rank: int) -> tuple[Path, int, subprocess.CompletedProcess[str]]:
    """A check whose other node never comes (``--join-timeout 2``), in the empty directory ``root``:
    ``root``, the endpoint's port and the finished process."""
    port = free_port()
    proc = subprocess.run(
        _check(port, node_rank, str(WOBBLE), timeout=2),
        cwd=root,
        env=user_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return root, port, proc


@pytest.fixture(scope="module")
def cut_short(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, int], Future[Any]]]:
    """The checks that end early, all started at once (most of their time is waiting: for a lost
    node's ``NODE_TIMEOUT``, for a join timeout); each test reads its own, which raises there."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        started = {("alone", r): pool.submit(alone, tmp_path_factory.mktemp(f"alone{r}"), r) for r in (0, 1)}
        if PROC:
            for k in (1, 0):
                started["killed", k] = pool.submit(kill_mid_check, tmp_path_factory.mktemp(f"kill{k}"), k)
        yield started


@pytest.mark.skipif(not PROC, reason="lists processes through /proc")
@pytest.mark.parametrize("killed", [1, 0])
def test_a_node_killed_mid_check_is_named_and_nothing_is_left_running(
    cut_short: dict[tuple[str, int], Future[Any]], killed: int
) -> None:
    code, verdict, stderr, left = cut_short["killed", killed].result()
    assert code == 2, stderr[-3000:]
    if killed == 1:  # the leader names the node it lost, after NODE_TIMEOUT
        assert "node 1 (host " in verdict["error"] and "stopped answering for 10 s" in verdict["error"]
        assert "torchrepro check: the script failed" not in stderr
    else:
        assert verdict["error"].startswith("this node lost the check on node 0"), verdict
    assert left == []


@pytest.mark.parametrize("node_rank", [0, 1])
def test_a_node_alone_ends_with_one_line_naming_the_endpoint(
    cut_short: dict[tuple[str, int], Future[Any]], node_rank: int
) -> None:
    root, port, proc = cut_short["alone", node_rank].result()
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = {
        0: f"1 of 2 nodes joined the check at 127.0.0.1:{port} within 2 s (--join-timeout)",
        1: f"no check answered at --rdzv-endpoint 127.0.0.1:{port} within 2 s (--join-timeout)",
    }[node_rank]
    assert said in proc.stderr
    assert "Traceback" not in proc.stderr and "frame #" not in proc.stderr, proc.stderr
    assert list(root.iterdir()) == []  # nothing created
