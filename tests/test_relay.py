"""A check across nodes, in process: what a follower forwards arrives byte for byte at its place,
never over the leader's own files; the verdict read back on a follower keeps its outcome; what a
check across nodes refuses. (The two-node checks themselves: ``tests/e2e/test_check_nodes.py``.)"""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import pytest

from torchrepro import cli
from torchrepro.check_nodes import _PREFIX, Control, _Inbox, _Outbox, _rewrite
from torchrepro.errors import SettingsError
from torchrepro.nodes import Nodes
from torchrepro.options import NOT_ACROSS_NODES, CheckOptions
from torchrepro.results import CheckResult, Coverage, Divergence, Isolation

NODES = Nodes(2, "127.0.0.1:29500")


@pytest.fixture
def stores() -> tuple[Control, Control]:
    """The leader's and a follower's end of one real store."""
    from torch.distributed import PrefixStore, TCPStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    leader = Control(NODES, PrefixStore(_PREFIX, server), 0, "127.0.0.1", port)
    follower = Control(NODES, PrefixStore(_PREFIX, client), 1, "127.0.0.1", port)
    return leader, follower


def test_forwarded_files_arrive_whole_events_as_they_are_written(
    stores: tuple[Control, Control], tmp_path: Path
) -> None:
    leader, follower = stores
    here, there = tmp_path / "leader", tmp_path / "follower"
    (there / "run0").mkdir(parents=True)
    (here / "run0").mkdir(parents=True)
    events = there / "run0" / "events.rank1.jsonl"
    (here / "run0" / "env.node0.json").write_text("leader's own")
    (there / "run0" / "env.node0.json").write_text("must not replace it")  # a name both nodes have
    (there / "run0" / "stderr.log").write_text("the follower's stderr")
    outbox = _Outbox(follower, 0, [(there / "run0", "run0", "")])
    inbox = _Inbox(here)
    events.write_bytes(b'{"a": 1}\n{"b": ')  # a line still being written is not sent
    outbox.stream()
    inbox.pull(leader, 0, 1)
    assert (here / "run0" / "events.rank1.jsonl").read_bytes() == b'{"a": 1}\n'
    events.write_bytes(b'{"a": 1}\n{"b": 2}\n' + b"x" * 3000 + b"\n")
    big = there / "run0" / "values.rank1.pt"
    big.write_bytes(bytes(range(256)) * 40000)  # 10 MB: in two pieces
    outbox.flush(there / "run0" / "stderr.log", "run0")
    follower.store.set("end/0/1", "{}")  # as a part ends: after everything it forwarded
    leader.store.wait(["end/0/1"])  # a set is not acknowledged: the leader reads in the order sent
    inbox.pull(leader, 0, 1)
    assert (here / "run0" / "events.rank1.jsonl").read_bytes() == events.read_bytes()
    assert (here / "run0" / "values.rank1.pt").read_bytes() == big.read_bytes()
    assert (here / "run0" / "env.node0.json").read_text() == "leader's own"
    assert (here / "run0" / "stderr.node1.log").read_text() == "the follower's stderr"
    assert not (here / "run0" / "stderr.log").exists()
    assert not leader.store.check(["fwd/0/1/0"])  # taken out of the store once written


def test_a_rewritten_events_file_is_sent_again_from_its_start(
    stores: tuple[Control, Control], tmp_path: Path
) -> None:
    leader, follower = stores
    (tmp_path / "b").mkdir()
    events = tmp_path / "b" / "events.rank1.jsonl"
    outbox = _Outbox(follower, 3, [(tmp_path / "b", "r", "")])
    inbox = _Inbox(tmp_path / "a")
    events.write_bytes(b"1111111111\n")
    outbox.stream()
    events.write_bytes(b"22\n")  # the process re-executed itself and started its record again
    outbox.stream()
    follower.store.set("end/3/1", "{}")
    leader.store.wait(["end/3/1"])
    inbox.pull(leader, 3, 1)
    assert (tmp_path / "a" / "r" / "events.rank1.jsonl").read_bytes().startswith(b"22\n")


def test_torchrun_flags_are_rewritten_per_launch() -> None:
    command = ["python", "-m", "x", "--rdzv-endpoint=h:1", "--rdzv-id=a", "--node-rank=0", "--", "t.py"]
    assert _rewrite(command, rdzv_endpoint="h:7", node_rank="1") == [
        "python", "-m", "x", "--rdzv-endpoint=h:7", "--rdzv-id=a", "--node-rank=1", "--", "t.py",
    ]  # fmt: skip


def test_a_verdict_read_back_on_a_follower_keeps_what_the_command_line_says() -> None:
    first = Divergence(
        step=2, rank=1, kind="compute", op="aten.mul.Tensor", location="t.py:9", key="optimizer0",
        name="grad:w", shape=(3, 4), dtype="float32",
    )  # fmt: skip
    result = CheckResult(
        reproducible=False,
        runs=2,
        steps_compared=3,
        first_divergence=first,
        check_dir="x",
        notes=("a note",),
        coverage=Coverage({0: {"compute": 3}, 1: {"compute": 3}}, (0, 1)),
        isolation=Isolation("overlay", "/w"),
        varied="1 vs 2 threads",
        optimizer_steps={"optimizer0": 3},
    )
    back = CheckResult.from_dict(result.to_dict(), check_dir="node 0:/x")
    assert back.to_dict() == result.to_dict()
    assert back.outcome is result.outcome and back.check_dir == "node 0:/x"
    failed = CheckResult(
        reproducible=None, runs=2, steps_compared=0, first_divergence=None, check_dir="x", error="e"
    )
    assert CheckResult.from_dict(failed.to_dict()).outcome.exit_code == 2


@pytest.mark.parametrize("vary", NOT_ACROSS_NODES)
def test_what_does_not_run_across_nodes_is_refused_with_the_way_on_one_node(vary: str) -> None:
    with pytest.raises(SettingsError, match=f"--vary {vary} is not supported across nodes"):
        CheckOptions(vary=vary, nodes=NODES)
    with pytest.raises(SettingsError, match="--repro is not supported across nodes"):
        CheckOptions(repro="out", nodes=NODES)
    CheckOptions(vary="threads", nodes=NODES)  # what does run across nodes is taken


def test_the_check_command_line_takes_the_node_flags() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(
        [
            "check",
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "h:29500",
            "--join-timeout",
            "9",
            "--nproc",
            "2",
            "t.py",
        ]
    )
    options = cli.check_options(args)
    assert options.nodes == Nodes(2, "h:29500", join_timeout=9) and options.nproc == 2
    with pytest.raises(SettingsError, match="--node-rank goes with --nnodes N"):
        cli.check_options(parser.parse_args(["check", "--node-rank", "1", "t.py"]))

    def failed(error: str) -> CheckResult:
        return CheckResult(
            reproducible=None, runs=2, steps_compared=0, first_divergence=None, check_dir="x", error=error
        )

    assert failed("run 1 of 2 failed because node 1 (host h) stopped answering for 10 s").node_failed
    assert failed("this node lost the check on node 0 (host h) at h:1 (DistNetworkError: reset)").node_failed
    assert not failed("run 1 of 2 failed with exit code 1 on node 1 (host h)").node_failed


def test_a_node_started_with_other_settings_than_the_leader_is_refused_before_anything_runs() -> None:
    import threading

    from torchrepro.check_nodes import connect
    from torchrepro.errors import LaunchError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = Nodes(2, f"127.0.0.1:{port}", join_timeout=3)
    leading: list[BaseException] = []

    def lead() -> None:
        try:
            connect(Nodes(2, nodes.endpoint, node_rank=0, join_timeout=3), {"steps": 3, "args": ["a"]})
        except LaunchError as exc:
            leading.append(exc)

    leader = threading.Thread(target=lead)
    leader.start()
    with pytest.raises(
        LaunchError, match=r"other settings than the check it joined .*steps: 5 here, 3 there"
    ):
        connect(Nodes(2, nodes.endpoint, node_rank=1, join_timeout=3), {"steps": 5, "args": ["a"]})
    leader.join()
    assert "1 of 2 nodes joined the check" in str(leading[0])  # the refused node never joined
