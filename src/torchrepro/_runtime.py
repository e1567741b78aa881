"""What the running process has started, asked in one place: CUDA, a process group, its rank.

Invariants:
- Asking never starts anything: ``cuda_started`` never initialises CUDA, ``process_group`` never
  imports ``torch.distributed`` when the process has not (it cannot have a group then), and this
  module imports nothing but the standard library at its top, so torch-free parts (the children's
  ``sitecustomize``) may use ``env_rank``.
- A process's rank and world size are the initialised process group's, else ``(0, 1)``; the rank
  an environment names (``env_rank``) is a different fact, used before a group exists.
- Whether ``torchrepro run`` configured this very process (``bootstrapped``, and whether it seeded
  it) is noted here by the child's session (``mark_bootstrapped``) and read by ``relaunch`` and the
  Lightning integration: the variables a run leaves in the environment do not say it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["bootstrapped", "cuda_started", "env_rank", "group_rank", "mark_bootstrapped", "process_group"]

_BOOTSTRAP = {"configured": False, "seeded": False}


def mark_bootstrapped(*, seeded: bool) -> None:
    """Note that torchrepro's child session configured this process (``seeded``: with a seed)."""
    _BOOTSTRAP.update(configured=True, seeded=seeded)


def bootstrapped(*, seeded: bool = False) -> bool:
    """Whether torchrepro's child session configured this process (``seeded``: and seeded it)."""
    return _BOOTSTRAP["configured"] and (_BOOTSTRAP["seeded"] or not seeded)


def cuda_started() -> bool:
    """Whether CUDA is initialised in this process (asking never initialises it)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def _group() -> Any:
    """``torch.distributed`` when this process has an initialised process group, else None."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def group_rank() -> int | None:
    """This process's rank in its initialised process group; None: it has none."""
    dist = _group()
    return None if dist is None else int(dist.get_rank())


def process_group(fixed: tuple[int, int] | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: ``fixed`` when given, else the initialised process group's, else ``(0, 1)``."""
    if fixed is not None:
        return fixed
    dist = _group()
    return (0, 1) if dist is None else (int(dist.get_rank()), int(dist.get_world_size()))


def env_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """The rank the environment names: ``RANK``, else ``LOCAL_RANK`` on node 0 (Lightning's
    subprocess launcher sets only ``LOCAL_RANK``, ``NODE_RANK`` and ``WORLD_SIZE``); None: none."""
    env = os.environ if environ is None else environ
    rank = env.get("RANK", "")
    if rank.isdigit():
        return int(rank)
    local = env.get("LOCAL_RANK", "")
    node = env.get("NODE_RANK", env.get("GROUP_RANK", "0"))
    if local.isdigit() and node in ("", "0"):
        return int(local)
    return None
