"""The python processes a script starts itself: configured and recorded like the script.

A recorded run's (and an audit's) environment puts ``spec.SITE_DIR`` first on ``PYTHONPATH``;
its ``sitecustomize`` calls ``adopt()`` in every python started with that environment: a rank
Lightning's ``strategy="ddp"`` starts as a new ``python script.py``, a
``torch.multiprocessing.spawn`` rank, a ``subprocess`` of ``sys.executable``. Invariants:
- A process outside a recorded run or an audit (``spec.in_run`` false) is left alone and never
  imports torch; neither do torchrepro's own processes (``python -m torchrepro...``: the
  bootstrap configures itself) nor multiprocessing helpers that run no ``Process`` (the
  resource tracker).
- An adopted child is configured like the bootstrap: seeded with the run's seed (the same seed
  every rank gets under ``--nproc``), the switches set, the hooks installed, before its first line
  (a multiprocessing child: seeded, and in an audit probed, before the parent's ``__main__`` is
  re-imported, configured before its target runs). DataLoader workers (target ``_worker_loop``)
  are only seeded early; torch seeds them itself, and they record nothing.
- The events file is chosen at a process's first event (``rankclaim.RankClaim``).
- Every rank that joins a process group notes the world size it saw (``runrecord.write_world``),
  so a check knows the ranks that exist, recorded or not.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from torchrepro.protocol import in_run

if TYPE_CHECKING:  # this module loads in every python of a run: only what it needs at start-up
    from collections.abc import Callable, Sequence

__all__ = ["adopt"]

_WORKER_MODULE = "torch.utils.data._utils.worker"
"""The module of the DataLoader worker loop (a ``Process`` target that must not be configured)."""


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
    from torchrepro.protocol import ChildSpec

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

    from torchrepro._child.session import configure

    session = configure(spec, None, main=False)
    atexit.register(session.close)


def _seed() -> None:
    """Before the parent's ``__main__`` is imported again: seed (a run) and install the audit's
    probe (an audit: so what that import seeds, the probe sees)."""
    spec = _spec()
    if spec is not None and spec.seed is not None:
        from torchrepro.seeding import seed_everything

        seed_everything(spec.seed)
    if spec is not None and spec.audit_settings_out:
        from torchrepro._child.probe import install_probe

        install_probe(spec.audit_settings_out, main=False)


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
