"""seed_everything across fresh processes: bitwise-equal training, and plain runs that differ."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cnn_basic.py"


def test_seed_everything_gives_bitwise_equal_training_across_processes(tmp_path: Path) -> None:
    runs = {"seeded_a": ["--seed", "123"], "seeded_b": ["--seed", "123"], "plain_a": [], "plain_b": []}
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--steps", "4", "--save", str(tmp_path / f"{name}.pt"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in runs.items()
    }
    fingerprints, params = {}, {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{name} failed:\n{err}"
        fingerprints[name] = out.strip().splitlines()[-1]
        params[name] = torch.load(tmp_path / f"{name}.pt", weights_only=True)

    def same(a: str, b: str) -> bool:
        return params[a].keys() == params[b].keys() and all(
            torch.equal(params[a][k], params[b][k]) for k in params[a]
        )

    assert same("seeded_a", "seeded_b"), "seed_everything(123) runs differ"
    assert fingerprints["seeded_a"] == fingerprints["seeded_b"]
    # Negative control: without seeding, plain PyTorch + NumPy + random give different weights.
    assert not same("plain_a", "plain_b"), "unseeded runs matched: the positive result proves nothing"
    assert fingerprints["plain_a"] != fingerprints["plain_b"]
