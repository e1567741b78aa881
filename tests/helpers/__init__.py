"""What many tests need, written once: this checkout's paths, a user's environment, the command
line in a subprocess, a free port, whether this machine lets a check isolate its runs.

``tests/`` is on ``sys.path`` (pytest's ``pythonpath``), so every test imports ``helpers``. The
scripts the tests start are plain python files and do not import it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

__all__ = [
    "ROOT",
    "SRC",
    "check_json",
    "free_port",
    "isolation_here",
    "line_of",
    "marked_line",
    "needs_isolation",
    "relative",
    "torchrepro",
    "torchrepro_here",
    "user_env",
]

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root."""
SRC = str(ROOT / "src")
"""This checkout's ``src``: first on every child's ``PYTHONPATH``, so children run the code under
test, not whatever an editable install points at (absolute: checks run from other directories)."""


def user_env(*, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """The environment a user's shell gives: this process's, without any ``TORCHREPRO_*`` variable
    (nor the names or prefixes in ``drop``), with ``SRC`` first on ``PYTHONPATH``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHREPRO_", *drop))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def torchrepro(
    cwd: Path | str, *args: str, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m torchrepro *args`` in ``cwd`` as a user would run it (``env``: ``user_env()``)."""
    return subprocess.run(
        [sys.executable, "-m", "torchrepro", *args],
        cwd=cwd,
        env=user_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrepro_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``torchrepro *args`` in this process (``cli.main``): (exit code, stdout, stderr). For commands
    that only read files, such as ``compare``: a subprocess would spend seconds importing torch to run
    the same code."""
    from torchrepro.cli import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def check_json(cwd: Path, *args: str, timeout: float = 300) -> tuple[int, dict[str, Any], str]:
    """Run ``torchrepro check --json *args`` in ``cwd``; return (exit code, verdict, stderr).

    No ``PYTHONHASHSEED`` is inherited either: ``--no-seed`` must see what plain python sees.
    """
    proc = torchrepro(cwd, "check", "--json", *args, timeout=timeout, env=user_env(drop=("PYTHONHASHSEED",)))
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be exactly one JSON object:\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, json.loads(lines[0]), proc.stderr


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@functools.cache
def isolation_here() -> dict[str, Any]:
    """How ``torchrepro check`` isolates its runs on this machine, probed once as the check probes
    it (``check._isolation``: layers outside the working directory, then the supervisor entering a
    throwaway overlay): ``{"mode": "overlay", "user_namespace": bool}`` (a user namespace: not
    root), or ``{"mode": "none", "reason": why}`` where the kernel refuses the overlay (a user
    namespace forbidden to unprivileged users, a container without the mount capability).

    The verdict's ``isolation`` depends on the machine: tests that need the overlay skip with the
    reason where it is refused, and the others expect what this says.
    """
    from torchrepro.isolation import Layers, probe

    with tempfile.TemporaryDirectory(prefix="torchrepro-isolation-probe-") as scratch:
        root = os.path.realpath(Path(scratch) / "cwd")
        check_dir = Path(root) / ".torchrepro" / "checks" / "probe"
        check_dir.mkdir(parents=True)
        layers = Layers.create(check_dir, root)
        if layers is None:
            return {"mode": "none", "reason": "no writable directory outside the working directory"}
        try:
            user_namespace, refused = probe(layers)
        finally:
            layers.close()
    if refused is not None:
        return {"mode": "none", "reason": f"the kernel refused an overlay ({refused})"}
    return {"mode": "overlay", "user_namespace": user_namespace}


def needs_isolation() -> None:
    """Skip the calling test, with the reason, where the kernel refuses a check's overlay."""
    import pytest

    found = isolation_here()
    if found["mode"] != "overlay":
        pytest.skip(f"needs a check's write isolation, which this machine refuses: {found['reason']}")


def processes_with(token: str) -> list[int]:
    """The pids of the processes (not this one) whose command line holds ``token`` (via /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if token.encode() in cmdline:
                found.append(int(entry))
    return found


def marked_line(path: Path, marker: str) -> int:
    """The number of the line of ``path`` that ends with the comment ``# <marker>``."""
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if text.rstrip().endswith(f"# {marker}"):
            return number
    raise AssertionError(f"{path.name} has no line marked {marker!r}")


def relative(path: Path) -> str:
    """``path`` relative to the current directory, as the audit shows a script it ran there."""
    return os.path.relpath(path, os.getcwd())


def line_of(script: Path, text: str) -> str:
    """``file:line`` (as the audit shows it) of the one line of ``script`` that contains ``text``."""
    lines = script.read_text(encoding="utf-8").splitlines()
    (number,) = [n for n, t in enumerate(lines, start=1) if text in t]
    return f"{relative(script)}:{number}"


def tree_sum(leaves: list[Any], node: tuple[int, int]) -> Any:
    """The sum of ``leaves[lo:hi]`` in the canonical tree (``invariant.tree.children``: each node
    ``left + right``), computed apart from InvariantDataParallel: what its gradients must equal."""
    from torchrepro.invariant.tree import children

    lo, hi = node
    if hi - lo == 1:
        return leaves[lo].clone()
    left, right = children(node)
    return tree_sum(leaves, left).add_(tree_sum(leaves, right))


@contextlib.contextmanager
def gloo_group_of_one(store: Path) -> Iterator[None]:
    """A gloo process group of one in this process (FSDP2 needs a mesh), destroyed after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
