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
- What the child does is said by one ``ChildSpec`` (``_child.spec``, the child protocol); what
  the run record holds is written through ``runrecord``. ``trace_step=k`` traces the ops of
  optimizer step k into the record (one file per rank) and notes it in ``settings.json``.
- ``relaunch`` re-executes the current process at most once (a marker variable), keeping its pid
  and environment (so a torchrun rank stays the rank its agent watches).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrepro import runrecord
from torchrepro._child.spec import RELAUNCHED_VAR, ChildSpec, python_hash_seed
from torchrepro.errors import LaunchError, SettingsError
from torchrepro.flags import CUBLAS_CONFIGS, CUBLAS_VAR, MODES
from torchrepro.seeding import validate_seed

__all__ = [
    "RunResult",
    "build_command",
    "child_env",
    "kill_tree",
    "launch",
    "python_hash_seed",
    "relaunch",
    "run_settings",
]

_bootstrapped = False
_bootstrap_seeded = False


def _mark_bootstrapped(*, seeded: bool) -> None:
    global _bootstrapped, _bootstrap_seeded
    _bootstrapped = True
    _bootstrap_seeded = seeded


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


def build_command(
    script: str | None, args: Sequence[str] = (), *, module: str | None = None, nproc: int | None = None
) -> list[str]:
    """The argv that runs ``script`` (or ``-m module``) under the bootstrap, via torchrun if ``nproc``."""
    if (script is None) == (module is None):
        raise LaunchError("give exactly one of a script path or -m MODULE")
    target = ["-m", module] if module is not None else ["--", os.fspath(script or "")]
    if nproc is None:
        return [sys.executable, "-m", _BOOTSTRAP, *target, *args]
    if nproc < 1:
        raise SettingsError(f"--nproc must be >= 1, got {nproc}")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*torchrun, "-m", _BOOTSTRAP, *target, *args]


def check_target(script: str | None, module: str | None) -> None:
    """Raise ``LaunchError`` naming the script or module when it cannot be found."""
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
        PYTHONHASHSEED=env.get("PYTHONHASHSEED"),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS"),
    )


@dataclass(frozen=True)
class RunResult:
    """What ``launch`` did: the script's exit code and where its record is (None: not recorded)."""

    returncode: int
    record_dir: str | None


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from ``/proc``; empty elsewhere."""
    tree = _children_map()
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int, *, grace: float = 0.0) -> None:
    """End ``pid`` and every process below it (new sessions included, e.g. torchrun ranks).

    With ``grace`` > 0 the tree first gets SIGTERM and that long to exit. Then every process is
    stopped (so none can fork a new one), the tree listed again, and everything killed.
    """
    if grace > 0:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)
    seen: set[int] = set()
    for _ in range(5):
        found = [p for p in [pid, *descendants(pid)] if p not in seen]
        if not found:
            break
        for p in found:
            seen.add(p)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGSTOP)
    for p in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return waited == 0


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Turn SIGTERM (and SIGHUP) into ``KeyboardInterrupt`` so ``finally`` blocks clean up."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


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
    trace_step: int | None = None,
    cpu_capability: str | None = None,
) -> RunResult:
    """Run a script to completion under the bootstrap with stdio inherited; return its exit code.

    ``record_dir=None`` records into a fresh ``.torchrepro/runs/<id>/``. ``trace_step=k`` also
    records an op trace of optimizer step k (0-based, the first optimizer's) per rank in the
    record, so ``torchrepro compare`` can name the op, module and line where two runs part at
    that step. ``cpu_capability`` pins ``ATEN_CPU_CAPABILITY`` (the CPU ISA torch's kernels use).
    Ctrl-C and SIGTERM end the whole process tree.
    """
    # validated before anything is created: a bad setting leaves no directory behind
    spec = ChildSpec(
        seed=seed,
        mode=mode if seed is not None else None,
        threads=threads,
        cpu_capability=cpu_capability,
        trace_step=trace_step,
        trace_out=None if trace_step is None else "",  # the record's path, filled in below
    )
    check_target(script, module)
    command = build_command(script, args, module=module, nproc=nproc)  # validates nproc
    run_dir = Path(record_dir) if record_dir is not None else runrecord.new_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in runrecord.stale_traces(run_dir):  # a reused record: old traces would mislead
        stale.unlink()
    spec = spec.replace(
        record_dir=os.fspath(run_dir.resolve()),
        trace_out=None if trace_step is None else os.fspath(runrecord.trace_prefix(run_dir, trace_step)),
    )
    env = spec.to_env()
    runrecord.write_run_files(
        run_dir, command, run_settings(spec, env, script=script, module=module, nproc=nproc)
    )
    proc = subprocess.Popen(command, env=env)
    try:
        with terminate_on_signals():
            returncode = proc.wait()
    except KeyboardInterrupt:
        kill_tree(proc.pid, grace=2.0)
        proc.wait()
        raise
    return RunResult(returncode=returncode, record_dir=os.fspath(run_dir))


def _start_settings_missing(seed: int, threads: int | None) -> dict[str, str]:
    """The process-start variables this process lacks, with the values it should have had."""
    missing: dict[str, str] = {}
    hash_seed = os.environ.get("PYTHONHASHSEED", "")
    if not hash_seed.isdigit():
        missing["PYTHONHASHSEED"] = str(python_hash_seed(seed))
    if threads is not None:
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            if os.environ.get(key) != str(threads):
                missing[key] = str(threads)
    return missing


def relaunch(seed: int = 0, mode: str = "strict", *, threads: int | None = None) -> int:
    """Call at the top of a script: make this process reproducible, re-executing it if needed.

    When a process-start setting is missing (``PYTHONHASHSEED``, and with ``threads`` the
    OMP/MKL variables), re-execute the same interpreter with the same argv (``sys.orig_argv``)
    and the settings added (``os.execve``: same pid, so a torchrun rank stays in place and keeps
    its rank variables). Then seed every RNG (``seed_everything(seed)``) and set the determinism
    switches (``set_determinism(mode)``). ``CUBLAS_WORKSPACE_CONFIG`` is set in place while CUDA
    is not initialised (a re-exec otherwise). Returns the seed in effect.

    Never loops: the re-executed process carries a marker and only warns if something is still
    missing. Under ``torchrepro run``/``check`` (already bootstrapped and seeded) it does nothing.
    """
    seed = validate_seed(seed)
    if mode not in MODES:
        raise SettingsError(f"mode must be one of {MODES}, got {mode!r}")
    if _bootstrapped and _bootstrap_seeded:
        from torchrepro.seeding import current_seed

        used = current_seed()
        return seed if used is None else used
    missing = _start_settings_missing(seed, threads)
    if os.environ.get(CUBLAS_VAR) not in CUBLAS_CONFIGS:
        import torch

        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            missing[CUBLAS_VAR] = CUBLAS_CONFIGS[0]
        else:
            os.environ[CUBLAS_VAR] = CUBLAS_CONFIGS[0]
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
    from torchrepro.flags import set_determinism
    from torchrepro.seeding import seed_everything

    seed_everything(seed)
    set_determinism(mode)
    return seed
