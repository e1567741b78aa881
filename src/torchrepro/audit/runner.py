"""Running a script under audit: the parent side of ``torchrepro audit``.

Invariants:
- ``audit_script`` runs the script the way its user would run it with plain ``python``: through
  the child bootstrap (``launch.build_command``) with an unseeded ``ChildSpec`` (no seeding, no
  switches, none of the caller's ``TORCHREPRO_*`` settings), with the op recorder and the settings
  probe on, stopped after ``steps`` optimizer steps. So the settings it reports are the ones the
  script itself sets (or inherits from the shell), not torchrepro's.
- The python processes the script starts (``multiprocessing``, ``mp.spawn``, ``subprocess`` of
  python) are probed too, each writing its own records (``runrecord.process_path``,
  ``runrecord.ops_process_path``), each stopped after ``steps`` steps; the report merges them
  (``audit.settings.merge_processes``), and names those that wrote nothing as not followed.
- The child is a process tree of its own: on a timeout, Ctrl-C or SIGTERM every process it
  started is ended (``launch.kill_tree``). The parent changes no global state.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchrepro import runrecord
from torchrepro.audit.report import AuditReport, report
from torchrepro.audit.settings import ProbeSettings, merge_processes
from torchrepro.errors import EnvFileError, LaunchError, TraceError
from torchrepro.launch import build_command, kill_tree, spawn, terminate_on_signals
from torchrepro.protocol import ChildSpec

__all__ = ["audit_script"]


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def audit_script(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    steps: int = 1,
    module: bool = False,
    timeout: float | None = None,
) -> AuditReport:
    """Run ``script`` (or, with ``module=True``, ``python -m script``) as plain python would, for
    ``steps`` optimizer steps with the op recorder on, and return what breaks determinism.

    The script runs in a fresh subprocess in the current directory, with the current environment
    minus any ``TORCHREPRO_*`` variable (no seeding, no determinism switches), so the settings
    findings describe the script as its user runs it. Raises ``LaunchError`` when the script is
    missing or fails (with the tail of its stderr), and ``ValueError`` for a bad ``steps``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    target = os.fspath(script)
    if not module and not Path(target).is_file():
        raise LaunchError(f"Cannot audit {target!r}: no such file (expected a Python training script).")
    with tempfile.TemporaryDirectory(prefix="torchrepro-audit-") as tmp:
        settings_path = Path(tmp) / "probe.json"
        ops_prefix = Path(tmp) / "ops"
        spec = ChildSpec(max_steps=steps, ops_out=str(ops_prefix), audit_settings_out=str(settings_path))
        command = build_command(None if module else target, args, module=target if module else None)
        returncode, output = _run(command, spec.to_env(), Path(tmp), timeout=timeout, target=target)
        if returncode != 0:
            raise LaunchError(
                f"The script {target!r} failed while audited (exit code {returncode}); "
                f"its last output:\n{_tail(output)}"
            )
        events = _read_events(Path(tmp), ops_prefix)
        settings = None
        if settings_path.is_file():
            children = [_read_settings(path) for path in runrecord.process_files(settings_path)]
            settings = merge_processes(_read_settings(settings_path), children)
    return report(script=target, steps=steps, events=events, settings=settings)


def _run(
    command: list[str], env: Mapping[str, str], tmp: Path, *, timeout: float | None, target: str
) -> tuple[int, str]:
    """Run the audited child as a process tree of its own; its exit code and captured output."""
    out_path = tmp / runrecord.STDERR_FILE
    with open(out_path, "wb") as out:
        proc = spawn(
            command, env=env, new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            with terminate_on_signals():
                returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            raise LaunchError(
                f"Auditing {target!r} took longer than {timeout} s; pass a larger timeout or fewer steps."
            ) from None
        except KeyboardInterrupt:
            kill_tree(proc.pid, grace=2.0)
            proc.wait()
            raise
        kill_tree(proc.pid)  # leftovers, e.g. DataLoader workers
    return returncode, out_path.read_text(encoding="utf-8", errors="replace")


def _read_json(path: Path) -> Any:
    try:
        return runrecord.read_json(path)
    except EnvFileError as exc:
        raise TraceError(f"Cannot read the audit's recording {path.name}: {exc}") from None


def _read_settings(path: Path) -> ProbeSettings:
    data = _read_json(path)
    try:
        return ProbeSettings.from_dict(data)
    except TraceError as exc:
        raise TraceError(f"Cannot read the audit's recording {path.name}: {exc}") from None


def _read_events(directory: Path, prefix: Path) -> list[dict[str, Any]]:
    """The op events of every process: the audited one, and the python children it started."""
    events: list[dict[str, Any]] = []
    files = runrecord.ops_files(directory)
    if not files:
        raise TraceError(
            "The audited script ran but left no op recording (expected ops.rank0.json from the bootstrap); "
            "was it started through torchrepro's bootstrap?"
        )
    for path in [*files, *runrecord.ops_process_files(prefix)]:
        data = _read_json(path)
        if isinstance(data, Mapping):
            data = data.get("events", [])
        if not isinstance(data, list):
            raise TraceError(f"The op recording {path.name} is not a list of events.")
        events.extend(data)
    return events
