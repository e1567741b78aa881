"""What the checkpoint tests share: models and optimizers with state, damaged files, a fresh
interpreter that imports this torchrepro."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from helpers import user_env


def warm_up_optimizer() -> None:
    """torch's first ``optimizer.step()`` imports dynamo, which writes TORCHINDUCTOR_CACHE_DIR into
    os.environ once per process; take that step at import, before the per-test environment guard."""
    p = torch.zeros(1, requires_grad=True)
    p.sum().backward()
    torch.optim.SGD([p], lr=0.1).step()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2))


def trained() -> tuple[nn.Module, torch.optim.Optimizer, Any, torch.amp.GradScaler]:
    """A model, SGD-momentum optimizer, scheduler and scaler that all carry non-default state."""
    g = torch.Generator().manual_seed(0)
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 1, 4, 4, generator=g)).sum().backward()
        opt.step()
        sched.step()
    scaler.scale(torch.ones(1))  # starts the scale tensor
    scaler.update(new_scale=77.0)
    return model, opt, sched, scaler


class Lossy:
    """A stateful object whose load_state_dict silently drops a key (a partial load)."""

    def __init__(self) -> None:
        self.state = {"a": 1, "b": 2}

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.state = {"a": d["a"], "b": 0}


def flip_tensor_byte(path: Path) -> None:
    """Flip one bit inside the largest tensor record (the zip stays structurally valid)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    offset = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size // 2
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def damage(kind: str, path: Path) -> None:
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(os.urandom(300))
    elif kind == "flipped-bit":
        flip_tensor_byte(path)
    elif kind == "plain-torch-save":
        torch.save({"model": torch.ones(3)}, path)
    elif kind == "pickled-object":
        torch.save({"fn": Lossy()}, path)


def run_child(script: str, *args: str) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter that imports this torchrepro; return its last line as JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=240, env=user_env()
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def assert_clean(error: BaseException) -> None:
    """Never a raw OS or torch traceback underneath."""
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def net(out: int = 2, dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, out)).to(dtype)
