"""Claim: ``import torchrepro`` adds under 60 ms over ``import torch`` (it is lazy), and importing
one part (``torchrepro.data``, ``torchrepro.seeding``) adds little and never loads the tracing
package.

Run: ``python benchmarks/import_time.py [--repeats 15]``.

Side by side in one run, alternating, each in a fresh interpreter: torch is imported first,
then each torchrepro import, and the child measures the second part alone with
``time.perf_counter`` (``import torch`` varies by ~100 ms run to run, which would drown a
difference of whole-process times). Reports the median added milliseconds, and that over the
median ``import torch``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CASES = {
    "torch": "pass",
    "torch + torchrepro": "import torchrepro",
    "torch + torchrepro.seeding": "import torchrepro.seeding",
    "torch + torchrepro.data": "from torchrepro.data import SeededLoader",
    "torch + torchrepro.checkpoint": "from torchrepro.checkpoint import load_checkpoint, save_checkpoint",
    "torch + torchrepro.trace (tracing)": "import torchrepro; torchrepro.trace",
}


def measure(extra: str) -> tuple[float, float]:
    """(seconds to import torch, seconds for ``extra`` after it), in a fresh interpreter."""
    code = (
        "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
        f"{extra}; print(t1 - t0, time.perf_counter() - t1)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    torch_s, extra_s = out.stdout.split()
    return float(torch_s), float(extra_s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch_times: list[float] = []
    added: dict[str, list[float]] = {name: [] for name in CASES}
    measure("pass")  # warm the file cache
    for _ in range(args.repeats):
        for name, extra in CASES.items():
            torch_s, extra_s = measure(extra)
            torch_times.append(torch_s)
            added[name].append(extra_s)
    base = statistics.median(torch_times)
    print(f"import torch: {base * 1e3:.0f} ms (median of {len(torch_times)})")
    for name in list(CASES)[1:]:
        extra_ms = statistics.median(added[name]) * 1e3
        print(f"{name:38} +{extra_ms:6.1f} ms  ({(base * 1e3 + extra_ms) / (base * 1e3):.3f}x)")


if __name__ == "__main__":
    main()
