"""Claim: a check whose runs part at step 5 of 500 takes a small fraction of two full runs.

Run: ``python benchmarks/check_early_stop.py [--steps 500] [--diverge-at 5]``.

The workload is a training script (small MLP, 500 optimizer steps) that re-seeds torch from
``os.urandom`` right before step 5. Side by side in one run:
- two full runs: the script run twice, one after the other, as plain ``python`` would;
- ``torchrepro check --no-locate``: both runs start together, are compared live, and every
  process is ended at the first divergence (step 5).
The ratio check/two-runs is printed. The machine may be shared: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import os, sys
import torch
from torch import nn
steps, at = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Dropout(0.1), nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
for step in range(steps):
    if step == at:
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--diverge-at", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT)
        argv = [str(args.steps), str(args.diverge_at)]
        start = time.perf_counter()
        subprocess.run([sys.executable, str(script), "0", "0"], check=True)
        startup = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(2):
            subprocess.run([sys.executable, str(script), *argv], check=True)
        two_runs = time.perf_counter() - start
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "torchrepro", "check", "--json", "--no-locate", str(script), *argv],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
        check = time.perf_counter() - start
    verdict = json.loads(out.stdout)
    print(f"divergence found: {verdict['first_divergence']}")
    print(f"two full runs ({args.steps} steps each, sequential): {two_runs:7.2f} s")
    print(f"torchrepro check (stops at step {args.diverge_at}):      {check:7.2f} s")
    print(f"one process start-up (0 steps, for scale):    {startup:7.2f} s")
    print(f"ratio check / two full runs: {check / two_runs:.3f}")


if __name__ == "__main__":
    main()
