"""What every section shares: the row it reports, the context it runs in, fresh child processes.

A ``Row`` is one claim checked or one figure measured:

- ``status``: ``pass`` (the claim holds), ``fail`` (it does not: the script exits 1), ``info`` (a
  measurement with no verdict: strict off differs or not, a cost ratio), ``skip`` (not run here,
  with the reason: no CUDA, a part not built yet), ``error`` (the check itself broke: exit 1).
- ``data``: JSON values for the machine-readable output (bits, timings, op outcomes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
STATUSES = ("pass", "fail", "info", "skip", "error")


@dataclasses.dataclass
class Row:
    section: str
    check: str
    status: str
    detail: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"row status must be one of {STATUSES}, not {self.status!r}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Row:
        return cls(d["section"], d["check"], d["status"], d.get("detail", ""), dict(d.get("data", {})))


@dataclasses.dataclass(frozen=True)
class Context:
    device: str  # "cuda" or "cpu" (the CPU self-test of the harness)
    quick: bool  # fewer steps and repeats (the CPU-side tests)
    workdir: Path  # a scratch folder of this section's own

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with this checkout's ``src`` first on ``PYTHONPATH``, no
    ``TORCHREPRO_*`` variable and no ``CUBLAS_WORKSPACE_CONFIG`` (a child sets what it tests)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TORCHREPRO_") and k != "CUBLAS_WORKSPACE_CONFIG"
    }
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")) if p
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclasses.dataclass
class ChildResult:
    returncode: int
    stdout: str
    stderr: str
    result: Any  # the JSON the child printed on its last stdout line, or None

    def tail(self, n: int = 600) -> str:
        text = self.stderr.strip() or self.stdout.strip()
        return text[-n:]


def run_python(
    code: str,
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    argv_prefix: tuple[str, ...] = (),
    timeout: float = 240,
) -> ChildResult:
    """Run ``code`` in a fresh ``python`` (or ``python -m torchrepro run ...`` via ``argv_prefix``)
    in ``cwd`` (made if missing).

    The code prints its result as one JSON line last; that line is parsed into ``result``.
    """
    cwd.mkdir(parents=True, exist_ok=True)
    script = cwd / f"child_{abs(hash(code)) % 10**8}.py"
    script.write_text(textwrap.dedent(code), encoding="utf-8")
    cmd = [sys.executable, *argv_prefix, str(script)]
    try:
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            env=child_env() if env is None else env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return ChildResult(-9, out, f"timed out after {timeout:.0f} s", None)
    result = None
    lines = proc.stdout.strip().splitlines()
    if lines:
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError:
            result = None
    return ChildResult(proc.returncode, proc.stdout, proc.stderr, result)
