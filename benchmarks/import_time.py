"""Claim: ``import torchrepro`` adds under 60 ms over ``import torch`` (it is lazy), and importing
one part (``torchrepro.data``, ``torchrepro.seeding``) adds little and never loads the tracing
package.

Run: ``python benchmarks/import_time.py [--repeats 15]``.

Side by side in one run, alternating, each in a fresh interpreter: the time to import torch
alone, and torch followed by each torchrepro import, measured inside the child with
``time.perf_counter`` (interpreter start-up excluded). Reports the median added milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CASES = {
    "torch": "",
    "torch + torchrepro": "import torchrepro",
    "torch + torchrepro.seeding": "import torchrepro.seeding",
    "torch + torchrepro.data": "import torchrepro.data",
    "torch + torchrepro.checkpoint": "import torchrepro.checkpoint",
    "torch + torchrepro.trace (tracing)": "import torchrepro; torchrepro.trace",
}


def measure(extra: str) -> float:
    code = f"import time; t = time.perf_counter(); import torch; {extra}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CASES}
    measure("")  # warm the file cache
    for _ in range(args.repeats):
        for name, extra in CASES.items():
            times[name].append(measure(extra))
    base = statistics.median(times["torch"])
    print(f"import torch: {base * 1e3:.0f} ms (median of {args.repeats})")
    for name in list(CASES)[1:]:
        added = statistics.median(times[name]) - base
        print(f"{name:38} +{added * 1e3:6.1f} ms  ({statistics.median(times[name]) / base:.3f}x)")


if __name__ == "__main__":
    main()
