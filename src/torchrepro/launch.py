"""Launching scripts with what only the process start can set.

Invariants:
- ``PYTHONHASHSEED`` and ``CUBLAS_WORKSPACE_CONFIG`` (and with ``threads`` the OMP/MKL thread
  variables) are in a child's environment before its interpreter starts; the bootstrap then seeds
  and sets the switches. The hash seed is ``derive_seed(seed, "PYTHONHASHSEED") % 2**32`` (the
  range PYTHONHASHSEED accepts), so it changes with the run's seed like every other RNG.
- ``--nproc N`` goes through ``python -m torch.distributed.run --standalone`` with the bootstrap
  as every rank's entry point; each rank records its own events.
- Every process a launch starts is ended with it: on a signal or an early stop the whole process
  tree is stopped, then killed (torchrun ranks and DataLoader workers included).
- What the child does is said by one ``ChildSpec`` (``protocol``, the child protocol); what
  the run record holds is written through ``runrecord``. ``trace_step=k`` traces the ops of
  optimizer step k into the record (one file per rank) and notes it in ``settings.json``.
- Launchers of ranks (``torchrun``, ``-m torch.distributed.run``, ``accelerate launch``) are
  refused as the target with the ``--nproc N`` command to use: ranks torchrepro starts itself
  are bootstrapped and known to a check from the start.
- ``relaunch`` re-executes the current process at most once (a marker variable), keeping its pid
  and environment (so a torchrun rank stays the rank its agent watches).
- ``portable=True`` starts the child with portable mode's variables (``portable.start_values``,
  validated before anything is created) and the child turns oneDNN off before the script runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrepro import _runtime, runrecord
from torchrepro._child.overlay import Overlay
from torchrepro._proc import descendants, exit_code, kill_tree
from torchrepro._runtime import cuda_started
from torchrepro.errors import LaunchError, SettingsError
from torchrepro.flags import CUBLAS_VAR, MODES, cublas_start_value
from torchrepro.nodes import Nodes
from torchrepro.portable import CBWR_VAR, CPU_CAPABILITY_VAR, disable_onednn, start_values
from torchrepro.portable import notes as portable_notes
from torchrepro.protocol import (
    HASH_SEED_VAR,
    MKL_THREADS_VAR,
    OMP_THREADS_VAR,
    RELAUNCHED_VAR,
    ChildSpec,
    python_hash_seed,
)
from torchrepro.seeding import validate_seed

__all__ = [
    "RunResult",
    "Terminated",
    "build_command",
    "child_env",
    "descendants",
    "kill_tree",
    "launch",
    "nproc_note",
    "python_hash_seed",
    "relaunch",
    "run_settings",
    "spawn",
    "start_notes",
]


def child_env(
    *,
    seed: int | None,
    mode: str | None = "strict",
    threads: int | None = None,
    record_dir: str | os.PathLike[str] | None = None,
    hash_seed: int | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a child: ``base`` (default ``os.environ``) plus the run's settings.

    Shorthand for ``ChildSpec(...).to_env(base)``. ``seed=None`` is a plain python run: nothing
    seeded, no switches, no pinned hash seed (the base environment's own ``PYTHONHASHSEED``, if
    any, is kept as python would). ``hash_seed`` overrides the derived ``PYTHONHASHSEED``.
    """
    spec = ChildSpec(
        seed=seed,
        mode=mode if seed is not None else None,
        threads=threads,
        record_dir=None if record_dir is None else os.fspath(record_dir),
        hash_seed=hash_seed,
    )
    return spec.to_env(base)


_BOOTSTRAP = "torchrepro._child.bootstrap"
_SUPERVISOR = "torchrepro._child.supervisor"
_TORCHRUN = "torchrepro._child.torchrun"
_WRITES = "torchrepro._child.writes"


def build_command(
    script: str | None,
    args: Sequence[str] = (),
    *,
    module: str | None = None,
    nproc: int | None = None,
    watch_writes: bool = False,
    nodes: Nodes | None = None,
) -> list[str]:
    """The argv that runs ``script`` (or ``-m module``) under the bootstrap, via torchrun if ``nproc``.

    ``watch_writes``: every rank notes the paths it writes in its record (``_child.writes``; a check).
    ``nodes``: this node's part of a run spanning nodes (torchrun's rendezvous flags instead of
    ``--standalone``; ``nproc`` ranks on this node, default 1).
    """
    if (script is None) == (module is None):
        raise LaunchError("give exactly one of a script path or -m MODULE")
    target = ["-m", module] if module is not None else ["--", os.fspath(script or "")]
    entry = _WRITES if watch_writes else _BOOTSTRAP
    if nodes is not None and nproc is None:
        nproc = 1
    if nproc is None:
        return [sys.executable, "-m", entry, *target, *args]
    if nproc < 1:
        raise SettingsError(f"--nproc must be >= 1, got {nproc}")
    where = ["--standalone"] if nodes is None else nodes.torchrun_args()
    torchrun = [sys.executable, "-m", _TORCHRUN, *where, f"--nproc-per-node={nproc}"]
    return [*torchrun, "-m", entry, *target, *args]


_LAUNCHER_SCRIPTS = ("torchrun", "accelerate")
_LAUNCHER_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "accelerate.commands.launch",
    "accelerate.commands.accelerate_cli",
)
_NPROC_OPTIONS = ("--nproc-per-node", "--nproc_per_node", "--num-processes", "--num_processes")


def _refuse_launcher(launcher: str, args: Sequence[str], command: str) -> LaunchError:
    """The error for ``torchrepro run|check torchrun ... script.py``: the ranks must be started
    by torchrepro (``--nproc``) to be bootstrapped and known to the check from the start."""
    nproc, script, rest = "N", "script.py", ["[args...]"]
    it = iter(enumerate(args))
    for i, arg in it:
        name, _, value = arg.partition("=")
        if name in _NPROC_OPTIONS:
            nproc = value or next(it, (0, "N"))[1]
        elif arg.endswith(".py"):
            script, rest = arg, list(args[i + 1 :])
            break
    suggestion = " ".join([f"torchrepro {command} --nproc {nproc}", script, *rest])
    return LaunchError(
        f"`torchrepro {command} {launcher} ...` is not supported: torchrepro starts the ranks itself, "
        f"so that every rank is seeded and recorded; run `{suggestion}` instead"
    )


def check_target(
    script: str | None, module: str | None, args: Sequence[str] = (), *, command: str = "run"
) -> None:
    """Raise ``LaunchError`` naming the script or module when it cannot be found, or when it is a
    launcher of ranks (torchrun, ``accelerate launch``: use ``--nproc`` instead)."""
    if script is not None and os.path.basename(script) in _LAUNCHER_SCRIPTS:
        launcher = os.path.basename(script) + (" launch" if args[:1] == ["launch"] else "")
        raise _refuse_launcher(launcher, args, command)
    if module is not None and module in _LAUNCHER_MODULES:
        raise _refuse_launcher(f"-m {module}", args, command)
    if script is None and module is None:
        raise LaunchError("no script given; usage: torchrepro run [options] script.py [args] (or -m module)")
    if script is not None and not os.path.isfile(script):
        raise LaunchError(f"script not found: {script!r} (no such file; cwd is {os.getcwd()})")
    if module is not None:
        import importlib.util

        sys.path.insert(0, os.getcwd())
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        finally:
            sys.path.pop(0)
        if spec is None:
            raise LaunchError(f"module not found: {module!r} (python -m {module} would fail the same way)")


def run_settings(
    spec: ChildSpec,
    env: Mapping[str, str],
    *,
    script: str | None,
    module: str | None,
    nproc: int | None,
    vary: str | None = None,
    run: int | None = None,
    nodes: Nodes | None = None,
) -> runrecord.RunSettings:
    """The ``settings.json`` of a run started from ``spec`` with the environment ``env``."""
    return runrecord.RunSettings(
        seed=spec.seed,
        mode=spec.mode,
        threads=spec.threads,
        nproc=nproc,
        script=script,
        module=module,
        cpu_capability=spec.cpu_capability,
        trace_step=spec.trace_step,
        trace_optimizer=None if spec.trace_step is None else spec.trace_optimizer,
        steps=spec.max_steps,
        vary=vary,
        run=run,
        PYTHONHASHSEED=env.get(HASH_SEED_VAR),
        OMP_NUM_THREADS=env.get(OMP_THREADS_VAR),
        portable=spec.portable,
        MKL_CBWR=env.get(CBWR_VAR),
        ATEN_CPU_CAPABILITY=env.get(CPU_CAPABILITY_VAR),
        nnodes=None if nodes is None else nodes.nnodes,
        node_rank=None if nodes is None else nodes.node_rank,
    )


@dataclass(frozen=True)
class RunResult:
    """What ``launch`` did: the script's exit code and where its record is (None: not recorded).

    ``returncode`` is the supervisor's (the script's exit code, 128+N for a death by signal N);
    ``exit_code`` is the same as a shell reports it; ``notes`` say what the user should know.
    """

    returncode: int
    record_dir: str | None
    notes: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        """The exit code a shell would report (128+N for a death by signal N)."""
        return exit_code(self.returncode)


def nproc_note(nproc: int | None) -> str | None:
    """A warning when ``nproc`` ranks exceed this machine's CPUs (None: nothing to say)."""
    cpus = os.cpu_count() or 1
    if nproc is not None and nproc > cpus:
        return (
            f"--nproc {nproc} is more than this machine's {cpus} CPU(s): the ranks share cores, "
            "which is slower (results are the same)"
        )
    return None


def spawn(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    new_session: bool = False,
    overlay: Overlay | None = None,
    **popen: Any,
) -> subprocess.Popen[bytes]:
    """Start ``command`` under the supervisor (``_child.supervisor``): nothing it starts outlives
    it, and nothing outlives this process, whatever ends it (even SIGKILL).

    ``overlay``: the supervisor first isolates the run's writes (``_child.overlay``; a check's runs).
    """
    isolate = [] if overlay is None else ["--overlay", overlay.to_arg()]
    argv = [sys.executable, "-m", _SUPERVISOR, str(os.getpid()), *isolate, "--", *command]
    return subprocess.Popen(argv, env=dict(env), start_new_session=new_session, **popen)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so that ``finally`` blocks clean up."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def _handling(signals: Sequence[int], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for ``signals`` while the block runs, then the handlers in place before (only
    the main thread can set handlers: elsewhere nothing changes)."""
    previous: dict[int, Any] = {}
    for sig in signals:
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)  # None: set outside Python


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while the block runs, then deliver the first that came (to the
    handler in place before the block).

    For starting a process and keeping its handle (``proc = spawn(...)``): a signal whose handler
    raises (``terminate_on_signals``, Ctrl-C) could otherwise interrupt ``subprocess.Popen`` after
    the child exists but before the caller holds it, and nothing would end that child.
    """
    pending: list[int] = []
    try:
        with _handling(
            (signal.SIGINT, signal.SIGTERM, signal.SIGHUP), lambda signum, _: pending.append(signum)
        ):
            yield
    finally:
        if pending:
            signal.raise_signal(pending[0])


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Turn SIGTERM (and SIGHUP) into ``KeyboardInterrupt`` so ``finally`` blocks clean up."""

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    with _handling((signal.SIGTERM, signal.SIGHUP), handler):
        yield


def launch(
    script: str | None,
    args: Sequence[str] = (),
    *,
    module: str | None = None,
    seed: int | None = 0,
    mode: str = "strict",
    threads: int | None = None,
    nproc: int | None = None,
    record_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    trace_step: int | None = None,
    cpu_capability: str | None = None,
    portable: bool = False,
    nodes: Nodes | None = None,
) -> RunResult:
    """Run a script to completion under the bootstrap with stdio inherited; return its exit code.

    ``record_dir=None`` records into a fresh ``.torchrepro/runs/<id>/``. ``trace_step=k`` also
    records an op trace of optimizer step k (0-based, the first optimizer's) per rank in the
    record, so ``torchrepro compare`` can name the op, module and line where two runs part at
    that step. ``cpu_capability`` pins ``ATEN_CPU_CAPABILITY`` (the CPU ISA torch's kernels use).
    ``portable`` starts it in portable mode (``torchrepro.portable``: results independent of the
    thread count and the CPU, as far as measured), recorded in its settings. ``record_dir`` must
    be new or empty unless ``overwrite`` (then its record files are replaced). Ctrl-C and SIGTERM
    end the whole process tree; so does this process's death. ``nodes``: this node's part of a run
    spanning nodes (``nodes.Nodes``; started with the same settings on every node): at the end
    every rank's records are in the record of the node holding global rank 0 (``_child.ship``).
    """
    # validated before anything is created: a bad setting leaves no directory behind
    spec = ChildSpec(
        seed=seed,
        mode=mode if seed is not None else None,
        threads=threads,
        cpu_capability=cpu_capability,
        trace_step=trace_step,
        trace_out=None if trace_step is None else "",  # the record's path, filled in below
        portable=portable,
        nnodes=None if nodes is None else nodes.nnodes,
    )
    check_target(script, module, args)
    command = build_command(script, args, module=module, nproc=nproc, nodes=nodes)  # validates nproc
    if nodes is not None and nproc is None:
        nproc = 1
    notes = tuple(n for n in [nproc_note(nproc), *start_notes(spec)] if n)
    run_dir = Path(record_dir) if record_dir is not None else runrecord.new_run_dir()
    with runrecord.claim(run_dir, overwrite=overwrite):
        spec = spec.replace(
            record_dir=os.fspath(run_dir.resolve()),
            trace_out=None if trace_step is None else os.fspath(runrecord.trace_prefix(run_dir, trace_step)),
        )
        env = spec.to_env()
        runrecord.write_run_files(
            run_dir, command, run_settings(spec, env, script=script, module=module, nproc=nproc, nodes=nodes)
        )
        # torchrun and its ranks get a session of their own: a Ctrl-C reaches only this process,
        # which ends them all quietly (otherwise every rank and the agent print tracebacks).
        proc: subprocess.Popen[bytes] | None = None
        try:
            with signals_held():  # a Ctrl-C while it starts comes once proc is known: the tree ends
                proc = spawn(command, env=env, new_session=nproc is not None)
            with terminate_on_signals():
                returncode = proc.wait()
        except KeyboardInterrupt:
            if proc is None:
                raise
            if nproc is None:  # the script got the Ctrl-C too: let it print its traceback and exit
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5.0)
            kill_tree(proc.pid)
            proc.wait()
            raise
    if nodes is not None and nodes.nnodes > 1:
        notes = (*notes, nodes_note(run_dir))
    return RunResult(returncode=returncode, record_dir=os.fspath(run_dir), notes=notes)


def nodes_note(run_dir: str | os.PathLike[str]) -> str:
    """Where a multi-node run's records are, said on the node whose record is ``run_dir``."""
    ranks = sorted(runrecord.ranks_present(run_dir))
    if runrecord.events_path(run_dir, 0).exists():
        nodes = sorted({node for node, _ in runrecord.read_nodes(run_dir).values()})
        return (
            f"this node held global rank 0: its record holds ranks {_span(ranks)} of "
            f"{len(nodes) or 1} node(s)"
        )
    if not ranks:
        return "no rank of this node joined a process group or recorded anything"
    return "global rank 0 ran on another node: this node's ranks sent their records to that node's record"


def _span(ranks: Sequence[int]) -> str:
    return (
        f"0-{ranks[-1]}"
        if ranks == list(range(len(ranks))) and len(ranks) > 1
        else ", ".join(map(str, ranks))
    )


def start_notes(spec: ChildSpec, base: Mapping[str, str] | None = None) -> list[str]:
    """What the user should know about ``spec``'s process-start settings (portable mode's kept
    values); raises ``SettingsError`` for a value in ``base`` (default ``os.environ``) it cannot use."""
    if not spec.portable:
        return []
    env = os.environ if base is None else base
    return portable_notes(start_values(env, cpu_capability=spec.cpu_capability))


def _start_settings_missing(seed: int, threads: int | None, portable: bool = False) -> dict[str, str]:
    """The process-start variables this process lacks, with the values it should have had."""
    missing: dict[str, str] = {}
    hash_seed = os.environ.get(HASH_SEED_VAR, "")
    if not hash_seed.isdigit():
        missing[HASH_SEED_VAR] = str(python_hash_seed(seed))
    if threads is not None:
        for key in (OMP_THREADS_VAR, MKL_THREADS_VAR):
            if os.environ.get(key) != str(threads):
                missing[key] = str(threads)
    if portable:
        for key, value in start_values(os.environ).items():
            if os.environ.get(key) != value:
                missing[key] = value
    return missing


def relaunch(
    seed: int = 0, mode: str = "strict", *, threads: int | None = None, portable: bool = False
) -> int:
    """Call at the top of a script: make this process reproducible, re-executing it if needed.

    When a process-start setting is missing (``PYTHONHASHSEED``, and with ``threads`` the
    OMP/MKL variables), re-execute the same interpreter with the same argv (``sys.orig_argv``)
    and the settings added (``os.execve``: same pid, so a torchrun rank stays in place and keeps
    its rank variables). ``portable=True`` adds portable mode's variables (``MKL_CBWR``, the CPU
    ISA: ``torchrepro.portable``) and turns oneDNN off. Then seed every RNG
    (``seed_everything(seed)``) and set the determinism switches (``set_determinism(mode)``).
    ``CUBLAS_WORKSPACE_CONFIG`` is set in place while CUDA is not initialised (a re-exec
    otherwise). Returns the seed in effect.

    Never loops: the re-executed process carries a marker and only warns if something is still
    missing. Under ``torchrepro run``/``check`` (already bootstrapped and seeded) it does nothing:
    there the command line decides (``--portable``).
    """
    seed = validate_seed(seed)
    if mode not in MODES:
        raise SettingsError(f"mode must be one of {MODES}, got {mode!r}")
    if _runtime.bootstrapped(seeded=True):
        from torchrepro.seeding import current_seed

        used = current_seed()
        return seed if used is None else used
    missing = _start_settings_missing(seed, threads, portable)
    cublas = cublas_start_value(mode, os.environ.get(CUBLAS_VAR))
    if cublas is not None:
        if cuda_started():
            missing[CUBLAS_VAR] = cublas
        else:
            os.environ[CUBLAS_VAR] = cublas
    if missing:
        if os.environ.get(RELAUNCHED_VAR):
            from torchrepro.errors import warn_once

            warn_once(
                "relaunch-missing",
                f"torchrepro.relaunch: still missing {sorted(missing)} after re-executing once; "
                "continuing without them. Set them in the environment that starts python.",
                stacklevel=3,
            )
        else:
            env = dict(os.environ)
            env.update(missing)
            env[RELAUNCHED_VAR] = "1"
            argv = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(sys.executable, argv, env)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if portable:
        disable_onednn()
    from torchrepro.flags import set_determinism
    from torchrepro.seeding import seed_everything

    seed_everything(seed)
    set_determinism(mode)
    return seed
