"""Which events file a process of a recorded run writes, decided at its first event.

Invariants:
- The rank is the process group's when one is initialised, else ``RANK`` (or ``LOCAL_RANK``, as
  Lightning's launcher sets it) when it is this process's own, not inherited from the process
  that started it (``PARENT_RANK_VAR``); the process torchrepro started defaults to rank 0.
- A file is created exclusively, so two processes never write the same one; a child with no rank
  of its own, or whose rank's file another process holds, records nothing and leaves an
  ``uncovered`` note instead, which makes a check inconclusive.
- Standard library only at import: every python of a run may load it before torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

from torchrepro._runtime import env_rank, group_rank
from torchrepro.protocol import mark_rank, parent_rank

if TYPE_CHECKING:
    from pathlib import Path
    from typing import IO

__all__ = ["RankClaim"]


class RankClaim:
    """Which events file a process writes, decided at its first event (see the invariants).

    ``main``: the process torchrepro started (a ``--nproc`` rank or the script itself), whose rank
    defaults to its ``RANK``, or 0. A child has a rank only from a process group or an
    environment rank of its own.
    """

    def __init__(self, record_dir: str, *, main: bool) -> None:
        self.record_dir = record_dir
        self.main = main
        self.rank: int | None = None
        start = env_rank()
        own = main or (None if start is None else str(start)) != parent_rank()
        self._env_rank = start if own else None
        mark_rank(str(self._env_rank if self._env_rank is not None else (0 if main else "")))

    def _resolve(self) -> tuple[int | None, str]:
        rank = group_rank()
        if rank is not None:
            return rank, ""
        if self._env_rank is not None:
            return self._env_rank, ""
        if self.main:
            return 0, ""
        why = "it trained in no process group and with no RANK or LOCAL_RANK of its own"
        return None, why

    def touch(self) -> None:
        """At exit of a main process that recorded nothing: leave its rank's empty events file,
        unless another process (a rank the script started) records that rank."""
        from torchrepro import runrecord

        rank, _ = self._resolve()
        if self.rank is None and rank is not None:
            with contextlib.suppress(OSError):
                os.close(os.open(runrecord.events_path(self.record_dir, rank), os.O_CREAT | os.O_EXCL, 0o666))

    def open(self) -> tuple[Path, IO[str]] | None:
        """Create this process's events file (``Recorder``'s ``claim``); None: record nothing."""
        from torchrepro import runrecord

        rank, why = self._resolve()
        if rank is not None:
            path = runrecord.events_path(self.record_dir, rank)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                why = f"it is rank {rank}, whose events another process of the run records"
            except OSError as exc:
                why = f"its events file could not be created: {exc}"
            else:
                self.rank = rank
                mark_rank(str(rank))
                return path, os.fdopen(fd, "w", encoding="utf-8")
        argv = getattr(sys, "orig_argv", sys.argv)
        try:
            runrecord.write_uncovered(self.record_dir, os.getpid(), argv, why)
        except (OSError, TypeError, ValueError) as exc:
            print(f"torchrepro: a python child was not recorded ({why}): {exc}", file=sys.stderr)
        return None
