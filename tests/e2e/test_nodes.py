"""Runs that span nodes: two ``torchrepro run --nnodes 2`` agents on this machine, each in its own
working directory with nothing shared but the rendezvous, stand for two nodes.

Shared launches: two InvariantDataParallel runs on 2 nodes x 2 processes (with stock DDP as the
negative control in the same processes) and one on a single process; two runs of a DDP script
whose rank 1 is nondeterministic (traced at step 0); two at a time. A node killed mid-run, and a
node that never joins (on each rendezvous backend: both at once, they mostly wait), are launches
of their own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from helpers import free_port, marked_line, processes_with, torchrepro, torchrepro_here, user_env

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
TRAIN = HERE.parent / "invariant" / "scripts" / "train.py"
WOBBLE = HERE / "node_scripts" / "rank1_wobble.py"


def _node_command(name: str, port: int, nproc: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torchrepro", "run", "--nnodes", "2", "--nproc", str(nproc),
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name, "--join-timeout", "120",
        "--record", "rec", *args,
    ]  # fmt: skip


def start_nodes(
    root: Path, name: str, nproc: int, *args: str
) -> tuple[list[Path], list[subprocess.Popen[str]], int]:
    """Start two agents of one run, each in its own directory under ``root / name``; the port."""
    port = free_port()
    dirs = [root / name / f"node{i}" for i in range(2)]
    procs = []
    for d in dirs:
        d.mkdir(parents=True)
        procs.append(
            subprocess.Popen(
                _node_command(name, port, nproc, *args),
                cwd=d,
                env=user_env(OMP_NUM_THREADS="1"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return dirs, procs, port


def run_nodes(root: Path, name: str, nproc: int, *args: str) -> dict[str, Any]:
    dirs, procs, _ = start_nodes(root, name, nproc, *args)
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    (home,) = [d for d in dirs if (d / "rec" / "events.rank0.jsonl").exists()]
    return {"dirs": dirs, "home": home, "stderr": [err for _, err in outputs]}


def run_single(directory: Path) -> dict[str, Any]:
    """The InvariantDataParallel run (and its DDP control) on one plain process: its ``out.json``."""
    directory.mkdir()
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "out.json", "--also", "ddp"],
        cwd=directory,
        env=user_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads((directory / "out.json").read_text()))


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("nodes")
    idp = ("--mode", "off", str(TRAIN), "out.json", "--also", "ddp")
    wobble = ("--trace-step", "0", str(WOBBLE))
    with ThreadPoolExecutor(max_workers=2) as pool:  # the machine is small: two launches at a time
        started = {
            **{name: pool.submit(run_nodes, root, name, 2, *idp) for name in ("idp_a", "idp_b")},
            "single": pool.submit(run_single, root / "single"),
            **{name: pool.submit(run_nodes, root, name, 1, *wobble) for name in ("wobble_a", "wobble_b")},
        }
        out: dict[str, Any] = {name: future.result() for name, future in started.items()}
    out["root"] = root
    return out


def test_every_nodes_records_end_on_the_node_holding_rank_0(launches: dict[str, Any]) -> None:
    run = launches["idp_a"]
    home = run["home"] / "rec"
    (other,) = [d / "rec" for d in run["dirs"] if d != run["home"]]
    events = sorted(p.name for p in home.glob("events.rank*.jsonl"))
    assert events == [f"events.rank{r}.jsonl" for r in range(4)]
    assert sorted(p.name for p in home.glob("env.node*.json")) == ["env.node0.json", "env.node1.json"]
    worlds = {r: json.loads((home / f"world.rank{r}.json").read_text()) for r in range(4)}
    nodes = {r: w["node"] for r, w in worlds.items()}
    assert sorted(nodes.values()) == [0, 0, 1, 1] and {w["world_size"] for w in worlds.values()} == {4}
    # the other node kept its own ranks' files (nothing it wrote is taken away), and only those
    kept = sorted(p.name for p in other.glob("events.rank*.jsonl"))
    assert kept == [f"events.rank{r}.jsonl" for r, n in nodes.items() if n == nodes[2]]
    for r in (2, 3):
        assert (home / f"events.rank{r}.jsonl").read_bytes() == (other / f"events.rank{r}.jsonl").read_bytes()
    assert not list(home.glob(".torchrepro-ship-*"))  # rank 0's marker is gone
    said = dict(zip(run["dirs"], run["stderr"], strict=True))
    assert "this node held global rank 0: its record holds ranks 0-3 of 2 node(s)" in said[run["home"]]
    assert "global rank 0 ran on another node" in said[other.parent]


def test_two_multi_node_runs_compare_identical(
    launches: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = (launches[n]["home"] / "rec" for n in ("idp_a", "idp_b"))
    code, out, err = torchrepro_here(capsys, "compare", "--json", str(a), str(b))
    verdict = json.loads(out)
    assert code == 0 and verdict["reproducible"] is True, out + err
    assert sorted(verdict["coverage"]["per_rank"]) == ["0", "1", "2", "3"]
    assert all(counts["compute"] > 0 for counts in verdict["coverage"]["per_rank"].values())


def test_invariant_data_parallel_on_2_nodes_x_2_processes_equals_1_process(launches: dict[str, Any]) -> None:
    runs = [json.loads((launches[n]["home"] / "out.json").read_text()) for n in ("idp_a", "idp_b")]
    single = launches["single"]
    for run in runs:
        assert len(run["final"]) == 4 and set(run["final"]) == set(single["final"]), (run, single)
    # negative control, in the same processes: stock DDP with accumulation parts with the world size
    assert runs[0]["also"]["ddp"] == runs[1]["also"]["ddp"]
    assert set(runs[0]["also"]["ddp"]) != set(single["also"]["ddp"])


def test_a_rank_1_nondeterminism_is_named_at_rank_1_its_node_and_line(
    launches: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = (launches[n]["home"] / "rec" for n in ("wobble_a", "wobble_b"))
    code, out, err = torchrepro_here(capsys, "compare", "--json", str(a), str(b))
    assert code == 1, out + err
    verdict = json.loads(out)
    first = verdict["first_divergence"]
    assert (first["rank"], first["op"]) == (1, "aten.mul.Tensor"), first
    assert first["location"].endswith(f"rank1_wobble.py:{marked_line(WOBBLE, 'nodes: rank 1 mul')}")
    node = json.loads((a / "world.rank1.json").read_text())
    assert f"rank 1 ran on node {node['node']} (host {node['host']})" in verdict["notes"]


def test_a_node_whose_environment_differs_is_named(launches: dict[str, Any], tmp_path: Path) -> None:
    from torchrepro.compare import compare_runs

    a, b = (launches[n]["home"] / "rec" for n in ("idp_a", "idp_b"))
    assert not [n for n in compare_runs(a, b).notes if "environment" in n]  # control: the nodes agree
    changed = tmp_path / "rec"
    shutil.copytree(a, changed)
    rank0_node = json.loads((a / "world.rank0.json").read_text())["node"]
    other = 1 - rank0_node
    env_file = changed / f"env.node{other}.json"
    env = json.loads(env_file.read_text())
    env.update(torch_version="2.99.0", num_threads=7)
    env_file.write_text(json.dumps(env))
    notes = compare_runs(changed, b).notes
    inside = [n for n in notes if f"node {other}" in n and "another environment than node" in n]
    across = [n for n in notes if n.startswith(f"node {other} runs in another environment in the two runs")]
    assert len(inside) == 1 and len(across) == 1, notes
    for note in inside + across:
        assert "torch_version '2.99.0'" in note or "'2.99.0'" in note, note
        assert "num_threads" in note


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="lists processes through /proc")
def test_a_node_killed_mid_run_ends_the_run_everywhere_and_leaves_nothing_running(tmp_path: Path) -> None:
    token = f"torchrepro-kill-{os.getpid()}"
    dirs, procs, port = start_nodes(tmp_path, "kill", 1, str(WOBBLE), "--sleep", "0.2", token)
    deadline = time.monotonic() + 120
    while not all(list((d / "rec").glob("world.rank*.json")) for d in dirs):  # both ranks joined
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
            p.communicate() for p in procs
        ]
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)  # the second node's torchrepro dies: its machine went away
    out, err = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=30)
    assert procs[0].returncode not in (0, None), out + err
    # one line names what was lost: the peer (a rank failed: c10d handed out the ranks by arrival,
    # so the survivor's may be 0 or 1) or the node serving the rendezvous
    lost = f"torchrepro: this node lost the rendezvous at 127.0.0.1:{port} (id kill)"
    assert re.search(r"torchrepro: rank [01] failed with", err) or lost in err, err[-3000:]
    deadline = time.monotonic() + 30
    while processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(token) == []


def never_joined(root: Path, backend: str) -> tuple[int, subprocess.CompletedProcess[str]]:
    """A run whose second node never comes (``--join-timeout 2``): the endpoint's port, the process."""
    port = free_port()
    args = ["--rdzv-backend", backend, "--node-rank", "0", "--join-timeout", "2"]
    proc = torchrepro(
        root, "run", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", *args, str(WOBBLE)
    )
    return port, proc


@pytest.fixture(scope="module")
def never_joins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    """A run whose second node never joins, on each rendezvous backend, both at once (most of their
    time is waiting for the join timeout); each test reads its own, which raises there."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {b: pool.submit(never_joined, tmp_path_factory.mktemp(b), b) for b in ("c10d", "static")}


@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_a_node_that_never_joins_ends_the_run_with_one_line(
    never_joins: dict[str, Future[Any]], backend: str
) -> None:
    port, proc = never_joins[backend].result()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        f"not every node joined the rendezvous at 127.0.0.1:{port} (id torchrepro) within 2 s" in proc.stderr
    )
    assert "Traceback" not in proc.stderr
