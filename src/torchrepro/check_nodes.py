"""``torchrepro check`` across nodes: the same command on every node, one check, one verdict.

Invariants:
- Every node runs ``torchrepro check --nnodes N --rdzv-endpoint HOST:PORT [...] script.py``. The
  check on the endpoint's host leads (``--node-rank 0``; without ``--node-rank``, the check that
  binds the port there): it serves a control store (a ``TCPStore``) at the endpoint and runs the
  check's logic; the others follow. A follower that cannot reach the store, or a leader that does
  not see every node join, within ``--join-timeout`` seconds, ends with one line (exit 2).
- Each run of the check (and each traced re-run) is a torchrun launch of its own with the static
  rendezvous at a fresh port of the endpoint's host, the leader as node 0: global rank 0 of every
  run, and so every run's rank-0 record, is on the leader; the followers are nodes 1..N-1 in the
  order they joined. The leader's flags decide every run (``Relay.start`` publishes the command and
  the ``ChildSpec``); a follower starts the same launch as its node rank, under the supervisor and
  its own isolation layers, in a check directory of its own, so it never writes the user's files.
- A follower forwards what its ranks write through the store (``_Outbox``): events lines as they
  are written (a divergence on any node stops every run early), every other file of the run's
  record and op-trace directories once its part of the run has ended, and its stderr as
  ``stderr.node<R>.log``. The leader writes them at the same place in its check directory
  (``_Inbox``), never over a file of its own; a follower's part ends (``end/<launch>/<node>``)
  only after everything was forwarded, so a run is complete on the leader when every part ended.
- Liveness: a follower beats every ``HEARTBEAT`` seconds; a follower silent for ``NODE_TIMEOUT``
  seconds is named (the run it was in fails with that line); a follower that loses the store
  stops its runs and ends. Every node exits with the leader's verdict's exit code (``verdict``;
  an error of the leader's is posted as a failed check), after which the leader waits up to
  ``GOODBYE_TIMEOUT`` for the followers to have read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrepro import runrecord
from torchrepro._child.ship import CHUNK as STORE_VALUE_MAX
from torchrepro._child.ship import LAUNCHER_FILES
from torchrepro._io import TMP_SUFFIX
from torchrepro.errors import LaunchError
from torchrepro.nodes import Nodes
from torchrepro.protocol import PATH_FIELDS, ChildSpec
from torchrepro.results import LEADER_ENDED, LOST_LEADER, NODE_LOST

if TYPE_CHECKING:
    from torchrepro.check_runs import Run
    from torchrepro.isolation import Layers
    from torchrepro.results import CheckResult

__all__ = ["GOODBYE_TIMEOUT", "HEARTBEAT", "NODE_TIMEOUT", "Control", "Relay", "connect", "follow", "lead"]

HEARTBEAT = 0.5
"""Seconds between a follower's signs of life."""
NODE_TIMEOUT = 10.0
"""Seconds a follower may stay silent before it is named lost (its check was killed, its machine
went away, or the network between the nodes failed)."""
GOODBYE_TIMEOUT = 10.0
"""Seconds the leader keeps its store up after the verdict, for the followers to read it."""
CHUNK = STORE_VALUE_MAX - (64 << 10)
"""The largest piece of a file one store value carries, in bytes (room left for its header)."""

_PREFIX = "torchrepro/check/"


def _endpoint(nodes: Nodes) -> tuple[str, int]:
    host, _, port = str(nodes.endpoint).rpartition(":")
    return host.strip("[]"), int(port)


def _serves(host: str, port: int, node_rank: int | None) -> bool:
    """Whether this node's check leads: ``--node-rank 0``, or (none given) it can bind the endpoint."""
    if node_rank is not None:
        return node_rank == 0
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))  # fails where the host is not this machine, or the port is taken
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Keep the store's C++ client from printing a stack trace per failed connection attempt (it
    writes to file descriptor 2 directly): a node that is not there is said in one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _command_line(nodes: Nodes) -> str:
    return f"torchrepro check --nnodes {nodes.nnodes} --rdzv-endpoint {nodes.endpoint} ... script.py"


@dataclasses.dataclass
class Control:
    """This node's end of a check across nodes: the store, its node number (0: the leader)."""

    nodes: Nodes
    store: Any
    node: int
    host: str
    port: int
    hosts: dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def leader(self) -> bool:
        return self.node == 0

    @property
    def followers(self) -> range:
        return range(1, self.nodes.nnodes)

    def where(self, node: int) -> str:
        """``node 1 (host h)``."""
        host = self.hosts.get(node)
        return f"node {node}" + (f" (host {host})" if host else "")

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None while it is not set (never blocks)."""
        if not self.store.check([key]):
            return None
        return bytes(self.store.get(key))

    def close(self) -> None:
        self.store = None


def connect(nodes: Nodes, agreed: dict[str, Any] | None = None) -> Control:
    """Lead or join the check at ``nodes.endpoint`` (see the invariants); ``LaunchError`` with one
    line when a node is missing after ``nodes.join_timeout`` seconds, or when this node was started
    with other ``agreed`` values (the script, its arguments, the options of the runs) than the
    leader: the leader's would decide every run, silently."""
    agreed = dict(agreed or {})
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    host, port = _endpoint(nodes)
    timeout = timedelta(seconds=nodes.join_timeout)
    if _serves(host, port, nodes.node_rank):
        try:
            server = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
        except Exception as exc:
            server = None
            if nodes.node_rank == 0:  # told to lead: the port must be free (without, another check took it)
                raise LaunchError(
                    f"this node leads the check (--node-rank 0 serves --rdzv-endpoint {nodes.endpoint}) but "
                    f"cannot listen on port {port} ({type(exc).__name__}: {exc}); choose a free port, the "
                    "same on every node"
                ) from None
        if server is not None:
            control = Control(nodes, PrefixStore(_PREFIX, server), 0, host, port, {0: socket.gethostname()})
            config = {"nnodes": nodes.nnodes, "host": socket.gethostname(), "agreed": agreed}
            control.store.set("config", json.dumps(config))
            _wait_for_nodes(control)
            return control
    try:
        with _quiet_stderr():
            client = TCPStore(host, port, is_master=False, timeout=timeout)
        store = PrefixStore(_PREFIX, client)
        store.wait(["config"], timeout)
        config = json.loads(store.get("config"))
    except Exception:
        raise LaunchError(
            f"no check answered at --rdzv-endpoint {nodes.endpoint} within {nodes.join_timeout} s "
            f"(--join-timeout): start `{_command_line(nodes)}` on the endpoint's host too (it leads "
            "the check), with the same --rdzv-endpoint on every node"
        ) from None
    if config["nnodes"] != nodes.nnodes:
        raise LaunchError(
            f"this node says --nnodes {nodes.nnodes} but the check it joined at {nodes.endpoint} says "
            f"--nnodes {config['nnodes']}: give every node the same flags"
        )
    theirs = config.get("agreed", {})
    differ = [k for k in sorted(set(agreed) | set(theirs)) if agreed.get(k) != theirs.get(k)]
    if differ:
        said = "; ".join(f"{k}: {agreed.get(k)!r} here, {theirs.get(k)!r} there" for k in differ)
        raise LaunchError(
            f"this node was started with other settings than the check it joined at {nodes.endpoint} "
            f"({said}): give every node the same command"
        )
    node = int(store.add("joined", 1))
    if node >= nodes.nnodes:
        raise LaunchError(
            f"more nodes than --nnodes {nodes.nnodes} joined the check at {nodes.endpoint}: this one "
            "is one too many (start the check once per node)"
        )
    store.set(f"host/{node}", socket.gethostname())
    return Control(nodes, store, node, host, port, {0: str(config.get("host") or "")})


def _wait_for_nodes(control: Control) -> None:
    nodes = control.nodes
    deadline = time.monotonic() + nodes.join_timeout
    joined = 0
    while time.monotonic() < deadline:
        joined = int(control.store.add("joined", 0))
        if joined >= nodes.nnodes - 1:
            for n in control.followers:
                control.hosts[n] = (control.get(f"host/{n}") or b"").decode() or "?"
            return
        time.sleep(0.05)
    raise LaunchError(
        f"{1 + joined} of {nodes.nnodes} nodes joined the check at {nodes.endpoint} within "
        f"{nodes.join_timeout} s (--join-timeout): start `{_command_line(nodes)}` on every node"
    )


def _rewrite(command: list[str], **flags: str) -> list[str]:
    """``command`` with torchrun's ``--<flag>=value`` flags set to ``flags`` (``node_rank=...``)."""
    out = list(command)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-") + "="
        out = [flag + value if token.startswith(flag) else token for token in out]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class Relay:
    """The leader's side of a check's runs across nodes (``check_runs.Run`` calls it)."""

    def __init__(self, control: Control, check_dir: Path) -> None:
        self.control = control
        self.check_dir = check_dir.resolve()
        self.launches = 0
        self.inbox = _Inbox(self.check_dir)
        self.beats: dict[int, tuple[bytes | None, float]] = {
            n: (None, time.monotonic()) for n in control.followers
        }
        self.lost: dict[int, str] = {}
        self.failed_at: dict[int, float] = {}  # launch -> when this node's part failed

    @property
    def nnodes(self) -> int:
        return self.control.nodes.nnodes

    @staticmethod
    def nodes_of(control: Control) -> Nodes:
        """The ``Nodes`` a run's command is built with (its endpoint and id are set at its start)."""
        n = control.nodes
        return Nodes(n.nnodes, n.endpoint, node_rank=0, backend="static", join_timeout=n.join_timeout)

    def _relative(self, path: str) -> str | None:
        real = os.path.realpath(path)
        if real == str(self.check_dir) or real.startswith(str(self.check_dir) + os.sep):
            return os.path.relpath(real, self.check_dir)
        return None

    def start(self, run: Run) -> list[str]:
        """Publish run's launch to the followers; the command this node starts it with."""
        k = self.launches
        self.launches += 1
        host = self.control.nodes.endpoint.rpartition(":")[0]  # type: ignore[union-attr]
        command = _rewrite(
            run.command,
            rdzv_endpoint=f"{host}:{_free_port()}",
            rdzv_id=f"check-{self.check_dir.name}-{k}",
            node_rank="0",
        )
        assert run.spec is not None
        spec = dataclasses.asdict(run.spec)
        relative = {}
        for name in PATH_FIELDS:
            if spec.get(name):
                rel = self._relative(spec[name])
                if rel is not None:
                    relative[name] = rel
        record = self._relative(os.fspath(run.record_dir))
        launch = {
            "index": run.index,
            "command": command,
            "spec": spec,
            "relative": relative,
            "record": record,
        }
        self.control.store.set(f"launch/{k}", json.dumps(launch))
        run.launch = k
        return command

    def _heard(self) -> None:
        """Note each follower's heartbeat; name those silent for ``NODE_TIMEOUT``."""
        now = time.monotonic()
        for n, (last, since) in self.beats.items():
            if n in self.lost:
                continue
            beat = self.control.get(f"alive/{n}")
            if beat != last:
                self.beats[n] = (beat, now)
            elif now - since > NODE_TIMEOUT:
                self.lost[n] = (
                    f"{self.control.where(n)} {NODE_LOST} for {NODE_TIMEOUT:.0f} s (its check was "
                    "killed, its machine went away, or the network between the nodes failed)"
                )

    def _ended(self, k: int) -> dict[int, int]:
        ended = {}
        for n in self.control.followers:
            value = self.control.get(f"end/{k}/{n}")
            if value is not None:
                ended[n] = int(json.loads(value)["returncode"])
        return ended

    def _pull(self, k: int) -> None:
        for n in self.control.followers:
            self.inbox.pull(self.control, k, n)

    def poll(self, run: Run, local: int | None) -> int | None:
        """The run's exit code once every node's part has ended (None: not yet); names a failed or
        lost node in ``run.failure``."""
        k = run.launch
        if k is None:
            return local
        self._pull(k)
        self._heard()
        ended = self._ended(k)
        lost = [n for n in self.control.followers if n in self.lost and n not in ended]
        if lost:
            run.failure = "because " + "; ".join(self.lost[n] for n in lost)
            return local if local else 1
        if local is None:
            failed = {n: rc for n, rc in ended.items() if rc != 0}
            if not failed:
                return None
            local = 0  # a follower's part failed: the run failed, whatever this node's part does
        elif local != 0 and len(ended) < self.nnodes - 1:
            failed_at = self.failed_at.setdefault(k, time.monotonic())
            if time.monotonic() - failed_at < NODE_TIMEOUT:
                return None  # the other parts end soon (their peer is gone): say which failed
        elif len(ended) < self.nnodes - 1:
            return None
        failed = {n: rc for n, rc in ended.items() if rc != 0}
        if local != 0:
            failed[0] = local
        if not failed:
            return 0
        run.failed_nodes = tuple(sorted(failed))
        parts = [f"exit code {rc} on {self.control.where(n)}" for n, rc in sorted(failed.items())]
        run.failure = "with " + " and ".join(parts)
        return failed[min(failed)]

    def stop(self, run: Run, *, kill_local: Any) -> None:
        """Stop every node's part of ``run``; once they ended, everything they forwarded is here."""
        k = run.launch
        if k is None:
            kill_local()
            return
        with contextlib.suppress(Exception):
            self.control.store.set(f"stop/{k}", "1")
        kill_local()
        deadline = time.monotonic() + NODE_TIMEOUT
        while time.monotonic() < deadline:
            self._pull(k)
            self._heard()
            if all(n in self._ended(k) or n in self.lost for n in self.control.followers):
                break
            time.sleep(0.05)
        self._pull(k)

    def post(self, payload: dict[str, Any]) -> None:
        """The verdict, to every follower; waits until they read it (``GOODBYE_TIMEOUT`` at most)."""
        self.control.store.set("verdict", json.dumps(payload, allow_nan=False))
        deadline = time.monotonic() + GOODBYE_TIMEOUT
        waiting = [n for n in self.control.followers if n not in self.lost]
        while waiting and time.monotonic() < deadline:
            waiting = [n for n in waiting if self.control.get(f"bye/{n}") is None]
            time.sleep(0.05)


@contextlib.contextmanager
def lead(control: Control, check_dir: Path) -> Iterator[Relay]:
    """The leader's relay while the check runs; an exception is posted to the followers as a
    failed check (they stop and exit 2) before it goes on."""
    relay = Relay(control, check_dir)
    try:
        yield relay
    except BaseException as exc:
        with contextlib.suppress(Exception):
            relay.post({"error": f"{LEADER_ENDED}: {type(exc).__name__}: {exc}"})
        raise
    finally:
        control.close()


class _Inbox:
    """The leader's end of forwarded files: writes each piece at its place below ``check_dir``."""

    def __init__(self, check_dir: Path) -> None:
        self.check_dir = check_dir
        self.seen: dict[tuple[int, int], int] = {}
        self.created: set[Path] = set()
        self.refused: set[Path] = set()

    def pull(self, control: Control, k: int, n: int) -> None:
        count = control.get(f"fwd/{k}/{n}/n")
        if count is None:
            return
        for seq in range(self.seen.get((k, n), 0), int(count)):
            key = f"fwd/{k}/{n}/{seq}"
            raw = bytes(control.store.get(key))
            control.store.delete_key(key)
            header, _, data = raw.partition(b"\n")
            self._write(json.loads(header), data)
            self.seen[(k, n)] = seq + 1

    def _write(self, header: dict[str, Any], data: bytes) -> None:
        rel = os.path.normpath(str(header["dir"]))
        if rel.startswith("..") or os.path.isabs(rel):
            return
        target = self.check_dir / rel / Path(str(header["name"])).name
        offset = int(header["offset"])
        if target in self.refused:
            return
        if target not in self.created:
            if target.exists():  # the leader's own file: never written over
                self.refused.add(target)
                return
            self.created.add(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "r+b" if offset and target.exists() else "wb") as f:
            f.seek(offset)
            f.write(data)


class _Outbox:
    """A follower's end of one launch: what its ranks wrote, forwarded to the leader."""

    def __init__(self, control: Control, k: int, sources: list[tuple[Path, str, str]]) -> None:
        self.control = control
        self.k = k
        self.sources = sources  # (local directory, its path below the check directory, name prefix)
        self.sent: dict[Path, int] = {}
        self.seq = 0

    def _files(self) -> Iterator[tuple[Path, str]]:
        for local, rel, prefix in self.sources:
            try:
                entries = sorted(local.iterdir())
            except OSError:
                continue
            for path in entries:
                name = path.name
                if (
                    name.startswith(prefix)
                    and name not in LAUNCHER_FILES  # a follower's own (its stderr goes under another name)
                    and TMP_SUFFIX not in name
                    and not name.startswith(".")
                    and path.is_file()
                ):
                    yield path, rel

    def _send(self, rel: str, name: str, offset: int, data: bytes) -> None:
        store = self.control.store
        for start in range(0, max(len(data), 1), CHUNK):
            header = json.dumps({"dir": rel, "name": name, "offset": offset + start}).encode()
            store.set(
                f"fwd/{self.k}/{self.control.node}/{self.seq}", header + b"\n" + data[start : start + CHUNK]
            )
            self.seq += 1
        store.set(f"fwd/{self.k}/{self.control.node}/n", str(self.seq))

    def _forward(self, path: Path, rel: str, *, whole_lines: bool) -> None:
        sent = self.sent.get(path, 0)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < sent:  # rewritten (a process that re-executed itself)
                    sent = 0
                f.seek(sent)
                data = f.read()
        except OSError:
            return
        if whole_lines:
            data = data[: data.rfind(b"\n") + 1]
        if data or (sent == 0 and path not in self.sent):
            self._send(rel, path.name, sent, data)
            self.sent[path] = sent + len(data)

    def stream(self) -> None:
        """Forward the events lines written since the last call."""
        for path, rel in self._files():
            if runrecord.is_events_file(path.name):
                self._forward(path, rel, whole_lines=True)

    def flush(self, stderr: Path, rel: str) -> None:
        """Forward everything (the part has ended), then this node's stderr of the run."""
        for path, where in self._files():
            self._forward(path, where, whole_lines=False)
        try:
            data = stderr.read_bytes()
        except OSError:
            data = b""
        self._send(rel, runrecord.node_stderr_name(self.control.node), 0, data)


@dataclasses.dataclass
class _Part:
    run: Run
    outbox: _Outbox
    rel: str


def _start_part(
    control: Control, launch: dict[str, Any], k: int, check_dir: Path, layers: Layers | None
) -> _Part:
    from torchrepro.check_runs import make_run

    spec = dict(launch["spec"])
    for name, rel in launch["relative"].items():
        spec[name] = os.fspath(check_dir / rel)
    command = _rewrite(list(launch["command"]), node_rank=str(control.node))
    command[0] = sys.executable
    rel = launch["record"] or f"launch{k}"
    run = make_run(int(launch["index"]), check_dir / rel, command, ChildSpec(**spec), ranks=0, layers=layers)
    sources = [(run.record_dir, rel, "")]
    for name in ("trace_out", "capture_out"):
        if name in launch["relative"]:
            prefix = Path(launch["relative"][name])
            sources.append((check_dir / prefix.parent, os.fspath(prefix.parent), prefix.name + "."))
    run.start()
    return _Part(run, _Outbox(control, k, sources), rel)


def _end_part(control: Control, k: int, part: _Part) -> None:
    part.run.stop()
    part.outbox.flush(part.run.record_dir / runrecord.STDERR_FILE, part.rel)
    proc = part.run.proc
    rc = -1 if proc is None or proc.returncode is None else proc.returncode
    control.store.set(f"end/{k}/{control.node}", json.dumps({"returncode": rc}))


def _beat(control: Control, stop: threading.Event) -> None:
    """A follower's heartbeat, on a connection of its own."""
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    try:
        timeout = timedelta(seconds=NODE_TIMEOUT)
        store = PrefixStore(_PREFIX, TCPStore(control.host, control.port, is_master=False, timeout=timeout))
        beat = 0
        while not stop.is_set():
            beat += 1
            store.set(f"alive/{control.node}", str(beat))
            stop.wait(HEARTBEAT)
    except Exception:
        return  # the main loop finds the store gone


def follow(control: Control, check_dir: Path, layers: Layers | None, *, poll_interval: float) -> CheckResult:
    """A follower's check: run this node's part of every launch the leader publishes until its
    verdict; return that verdict (or the failure that ended the check here)."""
    stop = threading.Event()
    beater = threading.Thread(target=_beat, args=(control, stop), name="torchrepro-heartbeat", daemon=True)
    beater.start()
    parts: dict[int, _Part] = {}
    k = 0
    where = f"{control.where(0)} at {control.nodes.endpoint}"
    payload: dict[str, Any]
    try:
        while True:
            launch = control.get(f"launch/{k}")
            if launch is not None:
                parts[k] = _start_part(control, json.loads(launch), k, check_dir, layers)
                k += 1
                continue
            verdict = control.get("verdict")
            if verdict is not None:
                payload = json.loads(verdict)
                control.store.set(f"bye/{control.node}", "1")
                break
            for i, part in list(parts.items()):
                if control.get(f"stop/{i}") is not None or part.run.poll():
                    _end_part(control, i, part)
                    del parts[i]
                else:
                    part.outbox.stream()
            time.sleep(poll_interval)
    except Exception as exc:
        lost = f"{LOST_LEADER} on {where} ({type(exc).__name__}: {exc})"
        payload = {"error": f"{lost}; its runs here were stopped"}
    finally:
        stop.set()
        for part in parts.values():
            part.run.stop()
    return _verdict(payload, control, check_dir)


def _verdict(payload: dict[str, Any], control: Control, check_dir: Path) -> CheckResult:
    from torchrepro.results import CheckResult

    here = (
        f"node {control.node} of {control.nodes.nnodes}: this node ran its ranks of every run; its own "
        f"records are in {os.path.abspath(check_dir)}"
    )
    verdict = payload.get("verdict")
    if verdict is None:
        return CheckResult(
            reproducible=None,
            runs=0,
            steps_compared=0,
            first_divergence=None,
            check_dir=os.fspath(check_dir),
            error=str(payload.get("error") or "the check ended without a verdict"),
            notes=(here,),
        )
    result = CheckResult.from_dict(verdict, check_dir=str(payload.get("check_dir")))
    return dataclasses.replace(
        result,
        leader=control.where(0),
        stderr_tail=str(payload.get("stderr_tail") or ""),
        notes=(*result.notes, here + f"; the verdict and every rank's records are on {control.where(0)}"),
    )
