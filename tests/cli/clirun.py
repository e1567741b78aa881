"""Run the ``torchrepro`` command line in a subprocess, as a user would (no TORCHREPRO_* inherited)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchrepro(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHREPRO_")}
    return subprocess.run(
        [sys.executable, "-m", "torchrepro", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
