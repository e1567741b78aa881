"""A multi-node run's records end on the node holding global rank 0, with no shared filesystem.

Invariants:
- Runs only in a torchrun rank of a run whose ranks span nodes (``ChildSpec.nnodes > 1``), after
  its session closed (every record file the rank writes is written). Files travel through
  torchrun's agent store (``MASTER_ADDR``/``MASTER_PORT``, the store every agent and rank already
  reaches; it lives until every agent has passed its exit barrier, so until every rank has left),
  under a prefix of the job's rendezvous id and restart count.
- Rank 0 leaves a marker file named by a fresh token in its record directory and posts the token
  when it starts (``post_token``), so no rank waits for rank 0 at its end. A rank that finds that
  file in its own record directory shares the directory (the same node, or a shared filesystem)
  and sends nothing: nothing is copied twice.
- Another rank sends every top-level file of its record directory that names its rank
  (``*.rank<R>*``); its node's local rank 0 also sends the files that name no rank (the node's
  environment, notes of unrecorded python children). Large files go in ``CHUNK``-byte parts.
- Rank 0 waits for every rank's manifest for up to ``TIMEOUT`` seconds, writes each file it
  receives atomically and never replaces one its directory already holds; a rank whose records
  did not come is named in one line (the record then lacks that rank, which a check reads as a
  rank that recorded nothing); when its own script failed (a peer it lost sends nothing) it waits
  ``CONNECT_TIMEOUT`` at most. Shipping never changes the script's exit code: a failure is one
  line on stderr.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from torchrepro._io import TMP_SUFFIX
from torchrepro.runrecord import COMMAND_FILE, ENV_FILE, LOCK_FILE, SETTINGS_FILE, STDERR_FILE, STDOUT_FILE

__all__ = [
    "CHUNK",
    "CONNECT_TIMEOUT",
    "LAUNCHER_FILES",
    "TIMEOUT",
    "files_to_ship",
    "post_token",
    "ship_records",
]

TIMEOUT = 120.0
"""Seconds rank 0 waits, all told, for the other ranks' manifests."""
CONNECT_TIMEOUT = 10.0
"""Seconds a rank waits to reach the store, and for rank 0's token (rank 0 too, when its script
failed: a peer it lost will send nothing)."""
CHUNK = 8 << 20
"""The largest value one store key holds, in bytes: the store's own limit (a larger value makes
torch's libuv ``TCPStore`` drop the connection)."""

_MARKER = ".torchrepro-ship-"
_RANKED = re.compile(r"(?:^|\.)rank(\d+)(?:\.|$)")
LAUNCHER_FILES = (COMMAND_FILE, SETTINGS_FILE, STDOUT_FILE, STDERR_FILE, LOCK_FILE, ENV_FILE)
"""Written by each node's launcher (or by rank 0 alone: the run's environment): never shipped."""


def files_to_ship(record_dir: str | os.PathLike[str], rank: int, *, local_zero: bool) -> list[Path]:
    """The files of ``record_dir`` rank ``rank`` sends (see the invariants), by name."""
    out: list[Path] = []
    try:
        entries = sorted(Path(record_dir).iterdir())
    except OSError:
        return out
    for path in entries:
        name = path.name
        if not path.is_file() or name.startswith(_MARKER) or name in LAUNCHER_FILES or TMP_SUFFIX in name:
            continue
        m = _RANKED.search(name)
        if (m is not None and int(m.group(1)) == rank) or (m is None and local_zero):
            out.append(path)
    return out


def _store(timeout: float) -> Any:
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )
    job = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"torchrepro/records/{job}/{restart}/", store)


def _torchrun_rank() -> tuple[int, int] | None:
    """``(rank, world size)`` of a torchrun rank that reaches its agent's store; None otherwise."""
    env = os.environ
    if not (
        env.get("MASTER_ADDR") and env.get("MASTER_PORT", "").isdigit() and env.get("RANK", "").isdigit()
    ):
        return None
    return int(env["RANK"]), int(env.get("WORLD_SIZE", "1") or 1)


def post_token(record_dir: str) -> None:
    """At the start of rank 0: leave the marker file in its record directory and post its token, so
    that a rank sharing the directory knows it at its end without waiting for rank 0."""
    found = _torchrun_rank()
    if found is None or found[0] != 0:
        return
    try:
        token = secrets.token_hex(8)
        (Path(record_dir) / (_MARKER + token)).touch()
        _store(CONNECT_TIMEOUT).set("token", token)
    except Exception as exc:
        print(
            f"torchrepro: rank 0 could not reach torchrun's store ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )


def ship_records(record_dir: str, *, failed: bool = False, timeout: float = TIMEOUT) -> None:
    """Send this rank's records to global rank 0's record directory (rank 0: receive them all).
    ``failed``: the script failed here, likely with a peer that is gone: wait ``CONNECT_TIMEOUT``
    at most."""
    found = _torchrun_rank()
    if found is None:
        return  # not a torchrun rank: nothing to ship to
    rank, world = found
    wait = min(timeout, CONNECT_TIMEOUT) if failed else timeout
    try:
        store = _store(CONNECT_TIMEOUT)
        if rank == 0:
            _receive(store, Path(record_dir), world, wait)
        else:
            _send(store, Path(record_dir), rank, local_zero=os.environ.get("LOCAL_RANK", "0") == "0")
    except Exception as exc:  # never turn a finished run into a failed one
        print(
            f"torchrepro: rank {rank} could not ship its records to the node of rank 0 "
            f"({type(exc).__name__}: {exc}); they stay in {record_dir} on this node",
            file=sys.stderr,
        )


def _send(store: Any, root: Path, rank: int, *, local_zero: bool) -> None:
    store.wait(["token"], timedelta(seconds=CONNECT_TIMEOUT))  # posted when rank 0 started
    token = store.get("token").decode()
    if (root / (_MARKER + token)).exists():
        store.set(f"done/{rank}", json.dumps({"shared": True}))
        return
    manifest = []
    for i, path in enumerate(files_to_ship(root, rank, local_zero=local_zero)):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts = max(1, -(-len(data) // CHUNK))
        for j in range(parts):
            store.set(f"file/{rank}/{i}/{j}", data[j * CHUNK : (j + 1) * CHUNK])
        manifest.append([path.name, i, parts])
    store.set(f"done/{rank}", json.dumps({"files": manifest}))


def _receive(store: Any, root: Path, world: int, timeout: float) -> None:
    from torchrepro._io import atomic_write_bytes

    try:
        missing = []
        deadline = time.monotonic() + timeout
        for rank in range(1, world):
            key = f"done/{rank}"
            try:
                store.wait([key], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            except Exception:
                missing.append(rank)
                continue
            manifest = json.loads(store.get(key))
            for name, i, parts in manifest.get("files", []):
                target = root / Path(name).name
                data = b"".join(store.get(f"file/{rank}/{i}/{j}") for j in range(parts))
                for j in range(parts):
                    store.delete_key(f"file/{rank}/{i}/{j}")
                if not target.exists():
                    atomic_write_bytes(target, data)
        if missing:
            print(
                f"torchrepro: the records of rank(s) {', '.join(map(str, missing))} did not reach the node "
                f"of rank 0 within {timeout:.0f} s; the record lacks them",
                file=sys.stderr,
            )
    finally:
        for marker in root.glob(_MARKER + "*"):
            marker.unlink(missing_ok=True)
