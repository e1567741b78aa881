"""Demo: the same training script run twice in fresh processes, with and without seeding.

    python examples/seed_demo.py [--seed N] [--steps N]

Runs examples/cnn_basic.py four times (two with ``torchrepro.seed_everything``, two without)
and prints the fingerprints of the trained parameters side by side. Exit code 0 when the seeded
runs match bit for bit and the unseeded ones do not.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "cnn_basic.py"


def start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def fingerprint_of(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"{SCRIPT.name} failed (exit {proc.returncode}):\n{err}")
    return out.strip().splitlines()[-1].removeprefix("fingerprint ")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    steps = ["--steps", str(args.steps)]
    print(f"Training {SCRIPT.name} ({args.steps} steps) in 4 fresh processes...", flush=True)
    procs = {
        "seeded": [start([*steps, "--seed", str(args.seed)]) for _ in range(2)],
        "plain": [start(steps) for _ in range(2)],
    }
    results = {name: [fingerprint_of(p) for p in pair] for name, pair in procs.items()}
    labels = {"seeded": f"with seed_everything({args.seed})", "plain": "without seeding"}
    width = max(len(label) for label in labels.values()) + 2
    print()
    print(f"{'':{width}}{'run 1':34}{'run 2':34}bitwise equal")
    for name, (first, second) in results.items():
        print(f"{labels[name]:{width}}{first:34}{second:34}{'yes' if first == second else 'no'}")
    print()
    seeded_equal = results["seeded"][0] == results["seeded"][1]
    plain_equal = results["plain"][0] == results["plain"][1]
    if seeded_equal and not plain_equal:
        print("Seeded runs are identical bit for bit; unseeded runs differ (Python, NumPy and torch RNGs).")
        return 0
    print("Unexpected: " + ("seeded runs differ." if not seeded_equal else "unseeded runs matched."))
    return 1


if __name__ == "__main__":
    sys.exit(main())
