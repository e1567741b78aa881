"""What a resume gives without torchrepro: the ground truth ``check --vary resume`` must agree with.

A script under test follows three conventions (``tests/resume/scripts/``): it prints
``START_STEP <n>`` (optimizer steps already done when it starts), saves its final ``state_dict``
to ``final.pt`` in its working directory, and SIGKILLs itself right after the checkpoint save of
optimizer step ``K`` when ``RESUME_CRASH_AFTER=K`` is set. Everything here runs the script with
plain ``sys.executable`` in a user's environment (no ``TORCHREPRO_*`` variable): torchrepro only
takes part when the script itself imports it.

Tests import it as ``ground_truth`` from ``tests/resume`` (pytest puts a test file's folder on
``sys.path``), or as ``resume.ground_truth`` from anywhere (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers import user_env

__all__ = ["FINAL", "GroundTruth", "plain_resume", "plain_run", "same_bits"]

FINAL = "final.pt"
"""The file, in the script's working directory, that holds its final ``state_dict``."""
_START_STEP = re.compile(r"^START_STEP (\d+)$", re.MULTILINE)


@dataclass(frozen=True)
class GroundTruth:
    """An uninterrupted run and a run killed after a step and restarted, both in plain python."""

    exact: bool
    """Whether the restarted run ended with the uninterrupted run's bits (every tensor of ``final.pt``)."""
    start_step: int
    """The ``n`` of the restarted run's ``START_STEP n`` line: where it resumed (0: from scratch)."""
    reference: dict[str, torch.Tensor]
    """``final.pt`` of the uninterrupted run."""
    resumed: dict[str, torch.Tensor]
    """``final.pt`` of the restarted run."""


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``a`` and ``b`` have the same keys and bitwise equal tensors (dtype and shape too)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


def _run(
    script: Path,
    args: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout: float,
    nproc: int | None = None,
) -> subprocess.CompletedProcess[str]:
    launcher = (
        [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    )
    return subprocess.run(
        [sys.executable, *launcher, str(script), *args],
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _tails(proc: subprocess.CompletedProcess[str], chars: int = 2000) -> str:
    return f"--- stdout (tail) ---\n{proc.stdout[-chars:]}\n--- stderr (tail) ---\n{proc.stderr[-chars:]}"


def _finished(proc: subprocess.CompletedProcess[str], what: str, cwd: Path) -> dict[str, torch.Tensor]:
    assert proc.returncode == 0, f"{what} in {cwd} exited with {proc.returncode}, expected 0\n{_tails(proc)}"
    final = cwd / FINAL
    assert final.is_file(), f"{what} in {cwd} exited 0 but wrote no {FINAL}\n{_tails(proc)}"
    state = torch.load(final, weights_only=True)
    assert isinstance(state, dict), f"{final} holds a {type(state).__name__}, expected a state dict"
    return state


def _plain(env: Mapping[str, str] | None) -> dict[str, str]:
    """``env`` (default: ``helpers.user_env()``) without ``TORCHREPRO_*`` and ``RESUME_CRASH_AFTER``."""
    return {
        k: v
        for k, v in (user_env() if env is None else env).items()
        if not k.startswith("TORCHREPRO_") and k != "RESUME_CRASH_AFTER"
    }


def _fresh(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=False)  # a leftover checkpoint would be resumed from
    return directory


def plain_run(
    script: Path,
    args: Sequence[str] = (),
    *,
    workdir: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    nproc: int | None = None,
) -> dict[str, torch.Tensor]:
    """Run ``script args`` once to its end in the new directory ``workdir``; return its ``final.pt``.

    ``env``, ``nproc``: as for ``plain_resume``.
    """
    cwd = _fresh(workdir)
    proc = _run(script, args, cwd=cwd, env=_plain(env), timeout=timeout, nproc=nproc)
    return _finished(proc, f"{script.name} {' '.join(args)}".strip(), cwd)


def plain_resume(
    script: Path,
    args: Sequence[str],
    *,
    crash_after: int,
    resume_args: Sequence[str] = (),
    workdir: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    nproc: int | None = None,
    reference: dict[str, torch.Tensor] | None = None,
) -> GroundTruth:
    """Run ``script args`` to its end in ``workdir/reference``; in ``workdir/resumed`` run it with
    ``RESUME_CRASH_AFTER=crash_after`` (it must die by SIGKILL), then again with ``resume_args``
    appended and without the variable; compare the two ``final.pt``.

    ``env`` (default: ``helpers.user_env()``) is the environment of all three runs, less any
    ``TORCHREPRO_*`` variable and ``RESUME_CRASH_AFTER`` except where set here. The reference
    runs at the same time as the other two (separate directories: they share nothing). ``nproc``:
    each run is ``torchrun --standalone --nproc_per_node nproc`` (every rank kills itself).
    ``reference``: the ``final.pt`` of an uninterrupted run of the same training (another variant of
    the script whose bug only touches saving and loading), instead of running one here.
    """
    if crash_after < 1:
        raise ValueError(f"crash_after counts optimizer steps from 1, got {crash_after}")
    base = _plain(env)
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(
            (lambda *_, **__: reference) if reference is not None else plain_run,
            script,
            args,
            workdir=workdir / "reference",
            env=base,
            timeout=timeout,
            nproc=nproc,
        )
        resumed, start_step = _crash_and_restart(
            script,
            args,
            [*args, *resume_args],
            crash_after,
            cwd=_fresh(workdir / "resumed"),
            env=base,
            timeout=timeout,
            nproc=nproc,
        )
        reference = running.result()
    return GroundTruth(
        exact=same_bits(reference, resumed), start_step=start_step, reference=reference, resumed=resumed
    )


def _crash_and_restart(
    script: Path,
    args: Sequence[str],
    restart_args: Sequence[str],
    crash_after: int,
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout: float,
    nproc: int | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """The resumed half of ``plain_resume``: the restarted run's ``final.pt`` and ``START_STEP``."""
    command = f"{script.name} {' '.join(args)}".strip()
    crashed = _run(
        script,
        args,
        cwd=cwd,
        env={**env, "RESUME_CRASH_AFTER": str(crash_after)},
        timeout=timeout,
        nproc=nproc,
    )
    killed = (
        crashed.returncode == -signal.SIGKILL
        if nproc is None
        else crashed.returncode != 0 and "Signal 9 (SIGKILL)" in crashed.stderr
    )
    assert killed, (
        f"{command} with RESUME_CRASH_AFTER={crash_after} in {cwd} exited with {crashed.returncode}, "
        f"expected {-signal.SIGKILL} (killed by SIGKILL after step {crash_after})\n{_tails(crashed)}"
    )
    assert not (cwd / FINAL).exists(), f"{command} wrote {FINAL} before it was killed at step {crash_after}"

    restarted = _run(script, restart_args, cwd=cwd, env=env, timeout=timeout, nproc=nproc)
    what = f"the restart ({script.name} {' '.join(restart_args)})"
    resumed = _finished(restarted, what, cwd)
    starts = _START_STEP.findall(restarted.stdout)
    assert len(starts) == 1, (
        f"{what} printed {len(starts)} 'START_STEP <n>' lines, expected 1\n{_tails(restarted)}"
    )
    return resumed, int(starts[0])
