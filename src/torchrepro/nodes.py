"""``Nodes``: how the ranks of a run span several machines, said as torchrun says it.

Invariants:
- The flags are torchrun's, spelled and meaning what they mean there (``--nnodes``,
  ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-backend``, ``--rdzv-id``), given to ``torchrepro
  run`` on every node; ``torchrun_args`` hands them to torchrun unchanged, in place of
  ``--standalone``. Elastic ``--nnodes MIN:MAX`` is refused: a run whose node count can change
  between restarts has no fixed world to record or compare.
- A ``Nodes`` is validated when it is built (``SettingsError``, one line naming the flag and the
  fix), before anything runs. Standard library only (the command line imports it at start).
- With the ``c10d`` backend (the default) torchrun hands out node ranks by arrival, so the node
  holding global rank 0 need not be ``--node-rank 0``; ``--node-rank`` is required by ``static``
  only, and passed to torchrun only there (c10d ignores it, with a warning).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchrepro.errors import SettingsError

__all__ = ["BACKENDS", "DEFAULT_RDZV_ID", "JOIN_TIMEOUT", "Nodes", "parse_nnodes"]

BACKENDS = ("c10d", "static")
"""The rendezvous backends torchrepro launches with (torchrun's; ``etcd`` needs a server it cannot
start or check for itself)."""
DEFAULT_RDZV_ID = "torchrepro"
"""The rendezvous id when ``--rdzv-id`` is not given (the same on every node, as it must be)."""

JOIN_TIMEOUT = 300
"""Seconds the nodes have to join the rendezvous (``--join-timeout``; torchrun's own is 600): a node
that never comes ends the run on every other node with one line naming the rendezvous."""

_ENDPOINT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")


def parse_nnodes(text: str) -> int:
    """``--nnodes``'s value: a node count >= 1. ``MIN:MAX`` (elastic) is refused with the fix."""
    value = str(text).strip()
    if ":" in value:
        low, _, high = value.partition(":")
        fixed = high if low == high else "N"
        raise SettingsError(
            f"--nnodes {value}: elastic node counts (MIN:MAX) are not supported: a run whose node count "
            f"can change between restarts has no fixed world to record or compare; give --nnodes {fixed}"
        )
    if not value.isdigit() or int(value) < 1:
        raise SettingsError(f"--nnodes must be a number of nodes >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Nodes:
    """The nodes of a multi-node run (see the module invariants).

    ``nnodes``: how many nodes take part (every one runs ``torchrepro run`` with the same flags but
    ``--node-rank``); ``node_rank``: this node's (``static`` needs it); ``endpoint``: ``HOST:PORT``
    of the rendezvous (a host every node reaches; with ``c10d`` the agent on that host serves it);
    ``backend``: ``BACKENDS``; ``rdzv_id``: the job's id, the same on every node;
    ``join_timeout``: seconds the nodes have to join (``JOIN_TIMEOUT``).
    """

    nnodes: int
    endpoint: str | None = None
    node_rank: int | None = None
    backend: str = "c10d"
    rdzv_id: str = DEFAULT_RDZV_ID
    join_timeout: int = JOIN_TIMEOUT

    def __post_init__(self) -> None:
        if isinstance(self.nnodes, str):
            object.__setattr__(self, "nnodes", parse_nnodes(self.nnodes))
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise SettingsError(f"--nnodes must be a number of nodes >= 1, got {self.nnodes!r}")
        if self.backend not in BACKENDS:
            raise SettingsError(
                f"--rdzv-backend must be one of {', '.join(BACKENDS)}, got {self.backend!r} "
                "(etcd needs a server torchrepro cannot start or check)"
            )
        if self.endpoint is None:
            raise SettingsError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, a host and free port every "
                "node reaches, the same on every node (e.g. the first node's hostname and 29500)"
            )
        m = _ENDPOINT.match(self.endpoint)
        if m is None or not 0 < int(m.group("port")) < 65536:
            raise SettingsError(
                f"--rdzv-endpoint must be HOST:PORT with a port from 1 to 65535, got {self.endpoint!r}"
            )
        if self.node_rank is not None and (
            isinstance(self.node_rank, bool)
            or not isinstance(self.node_rank, int)
            or not 0 <= self.node_rank < self.nnodes
        ):
            raise SettingsError(
                f"--node-rank must be from 0 to {self.nnodes - 1} (--nnodes {self.nnodes}), "
                f"got {self.node_rank!r}"
            )
        if self.backend == "static" and self.node_rank is None:
            raise SettingsError(
                "--rdzv-backend static needs --node-rank R on every node (0 on the node at --rdzv-endpoint); "
                "or use --rdzv-backend c10d, which numbers the nodes as they join"
            )
        if (
            isinstance(self.join_timeout, bool)
            or not isinstance(self.join_timeout, int)
            or self.join_timeout < 1
        ):
            raise SettingsError(f"--join-timeout must be a number of seconds >= 1, got {self.join_timeout!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", self.rdzv_id):
            raise SettingsError(
                f"--rdzv-id must be 1 to 128 letters, digits, '.', '_' or '-', got {self.rdzv_id!r}"
            )

    def torchrun_args(self) -> list[str]:
        """torchrun's flags for these nodes (in place of ``--standalone``)."""
        args = [
            f"--nnodes={self.nnodes}",
            f"--rdzv-backend={self.backend}",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={'timeout' if self.backend == 'static' else 'join_timeout'}={self.join_timeout}",
        ]
        if self.backend == "static":
            args.append(f"--node-rank={self.node_rank}")
        return args

    def describe(self) -> str:
        """One line for the user: ``node 1 of 2 (c10d rendezvous at host:29500, id job7)``."""
        which = "a node" if self.node_rank is None else f"node {self.node_rank}"
        return f"{which} of {self.nnodes} ({self.backend} rendezvous at {self.endpoint}, id {self.rdzv_id})"
