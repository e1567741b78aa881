"""Run ``torchrepro check --json`` in a subprocess as a user would, on this checkout's code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[2] / "src")


def check(tmp_path: Path, *args: str, timeout: float = 300) -> tuple[int, dict[str, Any], str]:
    """Run ``torchrepro check --json`` in ``tmp_path``; return (exit code, verdict, stderr).

    No TORCHREPRO_* or PYTHONHASHSEED is inherited (``--no-seed`` must see what plain python
    sees); this checkout's ``src`` comes first on PYTHONPATH, so the children (started in
    ``tmp_path``) run the code under test, not whatever an editable install points at.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHREPRO_")}
    env.pop("PYTHONHASHSEED", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "torchrepro", "check", "--json", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be exactly one JSON object:\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, json.loads(lines[0]), proc.stderr
