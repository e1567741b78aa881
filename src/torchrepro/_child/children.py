"""The python processes a script starts itself: configured and recorded like the script.

A recorded run's environment puts ``spec.SITE_DIR`` first on ``PYTHONPATH``; its
``sitecustomize`` calls ``adopt()`` in every python started with that environment: a rank
Lightning's ``strategy="ddp"`` starts as a new ``python script.py``, a
``torch.multiprocessing.spawn`` rank, a ``subprocess`` of ``sys.executable``. Invariants:
- A process outside a recorded run (``spec.in_run`` false) is left alone and never imports torch;
  neither do torchrepro's own processes (``python -m torchrepro...``: the bootstrap configures
  itself) nor multiprocessing helpers that run no ``Process`` (the resource tracker).
- An adopted child is configured like the bootstrap: seeded with the run's seed (the same seed
  every rank gets under ``--nproc``), the switches set, the hooks installed, before its first line
  (a multiprocessing child: seeded before the parent's ``__main__`` is re-imported, configured
  before its target runs). DataLoader workers (target ``_worker_loop``) are only seeded early;
  torch seeds them itself, and they record nothing.
- The events file is chosen at a process's first event (``RankClaim``): the process group's rank
  when one is initialised, else ``RANK`` (or ``LOCAL_RANK``, as Lightning's launcher sets it) when
  it is this process's own, not inherited from the process that started it (``PARENT_RANK_VAR``).
  A file is created exclusively, so two processes never write the same one; a child with no
  rank of its own, or whose rank's file another process holds, records nothing and leaves an
  ``uncovered`` note instead, which makes a check inconclusive.
- Every rank that joins a process group notes the world size it saw (``runrecord.write_world``),
  so a check knows the ranks that exist, recorded or not.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

from torchrepro._child.spec import in_run, mark_rank, parent_rank
from torchrepro._runtime import env_rank

if TYPE_CHECKING:  # this module loads in every python of a run: only what it needs at start-up
    from collections.abc import Callable, Sequence
    from pathlib import Path
    from typing import IO

__all__ = ["RankClaim", "adopt"]

_WORKER_MODULE = "torch.utils.data._utils.worker"
"""The module of the DataLoader worker loop (a ``Process`` target that must not be configured)."""


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
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), ""
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


def _started_module(argv: Sequence[str]) -> str | None:
    """The module of ``python [options] -m module ...`` (None: a script, ``-c`` or the REPL)."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, None)
        if arg == "-c" or not arg.startswith("-"):
            return None
    return None


def _is_multiprocessing(argv: Sequence[str]) -> bool:
    """A multiprocessing child: spawn's ``--multiprocessing-fork``, the forkserver, its tracker."""
    if "--multiprocessing-fork" in argv:
        return True
    command = argv[argv.index("-c") + 1] if "-c" in argv[:-1] else ""
    return command.lstrip().startswith("from multiprocessing")


def _spec() -> Any:
    from torchrepro._child.spec import ChildSpec

    try:
        return ChildSpec.from_env()
    except ValueError as exc:
        print(f"torchrepro: a python child was left unconfigured: {exc}", file=sys.stderr)
        return None


def _configure() -> None:
    spec = _spec()
    if spec is None:
        return
    import atexit

    from torchrepro._child.bootstrap import configure

    session = configure(spec, None, main=False)
    atexit.register(session.close)


def _seed() -> None:
    spec = _spec()
    if spec is not None and spec.seed is not None:
        from torchrepro.seeding import seed_everything

        seed_everything(spec.seed)


def _adopt_processes() -> None:
    """Configure the ``multiprocessing`` processes this one runs (stdlib patches, no torch yet):
    seed before the parent's ``__main__`` is re-imported (``spawn.prepare``), configure before
    a target runs unless it is a DataLoader worker (``BaseProcess._bootstrap``)."""
    import multiprocessing.process as mp_process
    import multiprocessing.spawn as mp_spawn

    prepare: Callable[..., Any] = mp_spawn.prepare
    bootstrap: Callable[..., Any] = mp_process.BaseProcess._bootstrap  # type: ignore[attr-defined]

    def prepare_seeded(*args: Any, **kwargs: Any) -> Any:
        _seed()
        return prepare(*args, **kwargs)

    def bootstrap_configured(self: Any, *args: Any, **kwargs: Any) -> Any:
        target = getattr(self, "_target", None)
        if getattr(target, "__module__", None) != _WORKER_MODULE:
            _configure()
        return bootstrap(self, *args, **kwargs)

    mp_spawn.prepare = prepare_seeded
    mp_process.BaseProcess._bootstrap = bootstrap_configured  # type: ignore[attr-defined]


def adopt(argv: Sequence[str] | None = None) -> None:
    """Configure this python process when it belongs to a recorded run (the ``sitecustomize``)."""
    if not in_run():
        return
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    module = _started_module(argv)
    if module is not None and module.split(".")[0] == "torchrepro":
        return
    if _is_multiprocessing(argv):
        _adopt_processes()
        return
    _configure()
