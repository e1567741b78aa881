"""Claim: ``torchrepro check --vary resume`` costs about three runs' work at most (run 1, run 2 up
to the kill, run 2 from the kill), i.e. at most ~1.5x two plain runs of the script one after the
other, on 2 cores.

Run: ``python benchmarks/resume_cost.py [--repeats 3]``.

Side by side in one run, alternating (order flipped every repeat), each a fresh process tree in a
fresh directory (a checkpoint left by one case must not be resumed by another):
- two plain runs: ``python script.py`` twice, one after the other;
- check: ``torchrepro check script.py`` (two recorded runs side by side);
- resume: ``torchrepro check --vary resume --resume-at K script.py`` (run 1 and run 2 side by
  side until run 2 is killed after step K, then run 2 started again in its files, compared).
on the demo (``examples/digits_train.py``: it saves no checkpoint, so the verdict is "restored
nothing", exit 3, after the same three parts) and on ``examples/resume_cnn.py`` (its own
torchrepro checkpoints, 2 DataLoader workers; exit 0). Wall time, median over ``--repeats``, and
the ratios resume / two plain runs and resume / check.
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
DEMO = str(ROOT / "examples" / "digits_train.py")
CNN = str(ROOT / "examples" / "resume_cnn.py")

SCRIPTS = {
    "digits_train.py (demo)": ([DEMO], 4),
    "resume_cnn.py --steps 24": ([CNN, "ckpts", "--steps", "24", "--save-every", "4"], 12),
}
"""name: (the script and its arguments, the kill point)"""


def wall(commands: list[list[str]], ok: tuple[int, ...] = (0,)) -> float:
    """Seconds to run ``commands`` one after the other, each in a fresh directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHREPRO_")}
    start = time.perf_counter()
    for cmd in commands:
        with tempfile.TemporaryDirectory() as cwd:
            done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        if done.returncode not in ok:
            raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    check = [sys.executable, "-m", "torchrepro", "check", "--no-locate"]
    for name, (script, kill) in SCRIPTS.items():
        cases = {
            "two plain runs": ([[sys.executable, *script]] * 2, (0,)),
            "check": ([[*check, *script]], (0,)),
            "check --vary resume": (
                [[*check, "--vary", "resume", "--resume-at", str(kill), *script]],
                (0, 3),
            ),
        }
        times: dict[str, list[float]] = {case: [] for case in cases}
        for repeat in range(args.repeats):
            order = list(cases) if repeat % 2 == 0 else list(reversed(cases))
            for case in order:
                commands, ok = cases[case]
                times[case].append(wall(commands, ok))
        medians = {case: statistics.median(values) for case, values in times.items()}
        print(f"{name}, killed after step {kill}: {args.repeats} alternating repeats, wall median (min-max)")
        for case, values in times.items():
            print(f"  {case:<22} {medians[case]:6.2f} s  ({min(values):.2f}-{max(values):.2f})")
        ratio = medians["check --vary resume"] / medians["two plain runs"]
        print(
            f"  resume / two plain runs: {ratio:.2f}x "
            f"(target <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'}); "
            f"resume / check: {medians['check --vary resume'] / medians['check']:.2f}x"
        )


if __name__ == "__main__":
    main()
