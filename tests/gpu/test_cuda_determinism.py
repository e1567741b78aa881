"""Strict mode on a real GPU: equal bits across fresh processes, and cuBLAS's start-up trap.

Run on a CUDA machine by ``benchmarks/gpu_validation.py`` (section ``tests``, with
``--require-cuda``); skipped with the reason elsewhere. The workloads are the validation's own
(``benchmarks/gpu_checks/models.py``): a CNN with BatchNorm and dropout, a GPT with embedding
backward, SDPA, LayerNorm and AdamW, in fp32 and under bf16 autocast.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, user_env

CHILD = """
import json, sys
import torchrepro
from gpu_checks import models
torchrepro.set_determinism(sys.argv[1])
torchrepro.seed_everything(0)
print(json.dumps({name: models.train(name, "check", 6, "cuda") for name in models.MODELS}))
"""

TOO_LATE = """
import torch, torchrepro
x = torch.randn(64, 64, device="cuda")
(x @ x).sum().item()
torchrepro.set_determinism("strict")
"""


def _python(tmp_path: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(code, encoding="utf-8")
    env = user_env(drop=("CUBLAS_WORKSPACE_CONFIG",))
    env["PYTHONPATH"] += f":{ROOT / 'benchmarks'}"
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.requires_cuda
def test_strict_mode_trains_to_equal_bits_in_two_fresh_processes(tmp_path: Path) -> None:
    runs = []
    for _ in range(2):
        proc = _python(tmp_path, CHILD, "strict")
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    for name in runs[0]:
        assert runs[0][name] == runs[1][name], f"{name}: strict runs differ"


@pytest.mark.requires_cuda
def test_cublas_started_before_strict_mode_is_refused_with_the_fix(tmp_path: Path) -> None:
    proc = _python(tmp_path, TOO_LATE)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "DeterminismError" in last and "CUBLAS_WORKSPACE_CONFIG" in last, proc.stderr[-2000:]
    # started under `torchrepro run`, the same matmuls run with the variable set in time
    script = tmp_path / "under_run.py"
    script.write_text(
        "import os, torch\nx = torch.randn(64, 64, device='cuda')\n(x @ x).sum().item()\n"
        "assert torch.are_deterministic_algorithms_enabled()\nprint(os.environ['CUBLAS_WORKSPACE_CONFIG'])\n",
        encoding="utf-8",
    )
    run = subprocess.run(
        [sys.executable, "-m", "torchrepro", "run", "--mode", "strict", str(script)],
        cwd=tmp_path,
        env=user_env(drop=("CUBLAS_WORKSPACE_CONFIG",)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] in (":4096:8", ":16:8")
