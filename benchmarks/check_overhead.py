"""Claim: ``torchrepro check script.py`` takes at most ~1.3x one plain run of the script.

Run: ``python benchmarks/check_overhead.py [--repeats 5] [--script examples/digits_train.py]``.

Side by side in one run, alternating (order flipped every repeat), each a fresh process tree:
- plain: ``python script.py``, one run;
- check: ``torchrepro check script.py``: two seeded, strict, recorded runs started together and
  compared step by step as they go (the CLI parent imports no torch; each child does).
Wall time, median over ``--repeats``, and the ratio check / plain. The two runs of a check share
the cores; their OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, set by check unless
the user chose a policy), so neither burns the other's cores spinning. Measured on 2 cores,
digits_train.py: 2.2-2.6x before that, 1.1x after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall(cmd: list[str], cwd: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHREPRO_")}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--script", default=str(ROOT / "examples" / "digits_train.py"))
    args = parser.parse_args()
    script = str(Path(args.script).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        cases = {
            "plain run": [sys.executable, script],
            "torchrepro check": [sys.executable, "-m", "torchrepro", "check", "--no-locate", script],
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for repeat in range(args.repeats):
            order = list(cases) if repeat % 2 == 0 else list(reversed(cases))
            for name in order:
                times[name].append(wall(cases[name], tmp))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{Path(script).name}: {args.repeats} alternating repeats, wall time median (min-max)")
    for name, values in times.items():
        print(f"  {name:<18} {medians[name]:6.2f} s  ({min(values):.2f}-{max(values):.2f})")
    ratio = medians["torchrepro check"] / medians["plain run"]
    print(f"check / plain: {ratio:.2f}x (target <= 1.3x: {'met' if ratio <= 1.3 else 'NOT met'})")


if __name__ == "__main__":
    main()
