"""``nodes.Nodes`` (torchrun's multi-node flags), the command line's use of them, and which record
files a rank of a multi-node run ships (``_child.ship``); the runs themselves: tests/e2e/test_nodes.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import torchrepro
from torchrepro._child.ship import files_to_ship
from torchrepro.errors import SettingsError
from torchrepro.launch import build_command
from torchrepro.nodes import JOIN_TIMEOUT, Nodes, parse_nnodes


def test_torchrun_gets_the_rendezvous_in_place_of_standalone() -> None:
    nodes = Nodes(nnodes=2, endpoint="node-a:29500", rdzv_id="job7")
    argv = build_command("t.py", ["--lr", "1"], nproc=4, nodes=nodes)
    assert "--standalone" not in argv
    i = argv.index("torchrepro._child.torchrun")
    assert argv[i + 1 : i + 7] == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node-a:29500",
        "--rdzv-id=job7",
        f"--rdzv-conf=join_timeout={JOIN_TIMEOUT}",
        "--nproc-per-node=4",
    ]
    assert argv[-3:] == ["t.py", "--lr", "1"]
    # one rank a node by default; static passes the node rank (c10d numbers nodes as they join)
    static = build_command("t.py", nodes=Nodes(nnodes=3, endpoint="[::1]:1", node_rank=2, backend="static"))
    assert "--node-rank=2" in static and "--rdzv-conf=timeout=300" in static
    assert "--nproc-per-node=1" in static
    assert "--standalone" in build_command("t.py", nproc=2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"endpoint": None}, "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        ({"endpoint": "node-a"}, "--rdzv-endpoint must be HOST:PORT"),
        ({"endpoint": "node-a:70000"}, "--rdzv-endpoint must be HOST:PORT with a port from 1 to 65535"),
        ({"node_rank": 2}, "--node-rank must be from 0 to 1 (--nnodes 2), got 2"),
        ({"backend": "etcd"}, "--rdzv-backend must be one of c10d, static"),
        ({"backend": "static"}, "--rdzv-backend static needs --node-rank R"),
        ({"rdzv_id": "a b"}, "--rdzv-id must be 1 to 128 letters"),
        ({"join_timeout": 0}, "--join-timeout must be a number of seconds >= 1"),
        ({"nnodes": 0}, "--nnodes must be a number of nodes >= 1"),
    ],
)
def test_bad_node_settings_are_refused_naming_the_flag(changes: dict, message: str) -> None:
    values = {"nnodes": 2, "endpoint": "node-a:29500", **changes}
    with pytest.raises(SettingsError, match="^" + __import__("re").escape(message)):
        Nodes(**values)


def test_elastic_node_counts_are_refused_with_the_fix() -> None:
    assert parse_nnodes("4") == 4
    with pytest.raises(SettingsError, match=r"--nnodes 2:4: elastic .* give --nnodes N$"):
        parse_nnodes("2:4")
    with pytest.raises(SettingsError, match=r"give --nnodes 3$"):
        parse_nnodes("3:3")
    with pytest.raises(SettingsError, match="--nnodes must be a number of nodes >= 1, got 'two'"):
        parse_nnodes("two")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "1:2", "--rdzv-endpoint", "h:1"], "elastic node counts (MIN:MAX) are not supported"),
        (["--node-rank", "1"], "--node-rank goes with --nnodes N"),
        (["--rdzv-endpoint", "h:1", "--rdzv-id", "x"], "--rdzv-endpoint, --rdzv-id go with --nnodes N"),
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    ],
)
def test_the_command_line_refuses_bad_node_flags_with_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit('must not run')\n")
    proc = torchrepro(tmp_path, "run", *args, str(script))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "must not run" not in proc.stderr
    assert not (tmp_path / ".torchrepro").exists()  # refused before any record was made


def test_a_rank_ships_the_files_naming_it_and_local_rank_0_the_nodes_own(tmp_path: Path) -> None:
    names = [
        "events.rank2.jsonl",
        "events.rank3.jsonl",
        "world.rank2.json",
        "trace-step0.rank2",
        "trace-step0.rank12",
        "states.rank2.jsonl",
        "env.node1.json",
        "uncovered.pid77.json",
        "command.json",
        "settings.json",
        "stdout.log",
        "env.json",
        ".torchrepro-ship-abc",
        "events.rank2.jsonl.tmp-torchrepro123",
    ]
    for name in names:
        (tmp_path / name).write_text("x")
    (tmp_path / "sub.rank2").mkdir()  # not a file
    shipped = [p.name for p in files_to_ship(tmp_path, 2, local_zero=False)]
    assert shipped == ["events.rank2.jsonl", "states.rank2.jsonl", "trace-step0.rank2", "world.rank2.json"]
    with_node = [p.name for p in files_to_ship(tmp_path, 2, local_zero=True)]
    assert sorted(set(with_node) - set(shipped)) == ["env.node1.json", "uncovered.pid77.json"]
    assert files_to_ship(tmp_path / "missing", 2, local_zero=True) == []


def test_help_shows_the_node_flags() -> None:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "torchrepro", "run", "--help"], capture_output=True, text=True
    )
    for flag in (
        "--nnodes",
        "--node-rank",
        "--rdzv-endpoint",
        "--rdzv-backend",
        "--rdzv-id",
        "--join-timeout",
    ):
        assert flag in proc.stdout
