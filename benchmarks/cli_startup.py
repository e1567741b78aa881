"""Claim: the command line's parent process never imports torch (``--version``/``--help`` well
under 0.3 s), and ``torchrepro run`` adds to a plain ``python script.py`` only what the child does.

Run: ``python benchmarks/cli_startup.py [--repeats 7]``.

Side by side in one run, alternating, each a fresh process (wall time, median): ``torchrepro
--version``, ``torchrepro --help``, ``python -c "import torch"``, and a script that only imports
torch, run by plain ``python`` and by ``torchrepro run`` (which also seeds, sets the switches,
records and writes the environment fingerprint in the child).
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


def wall(cmd: list[str], cwd: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHREPRO_")}
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "imports_torch.py"
        script.write_text("import torch\n")
        tr = [sys.executable, "-m", "torchrepro"]
        cases = {
            "torchrepro --version": [*tr, "--version"],
            "torchrepro --help": [*tr, "--help"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "python script.py": [sys.executable, str(script)],
            "torchrepro run script.py": [*tr, "run", str(script)],
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        wall(cases["python script.py"], tmp)  # warm the file cache
        for _ in range(args.repeats):
            for name, cmd in cases.items():
                times[name].append(wall(cmd, tmp))
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in med.items():
        print(f"{name:28} {t:6.2f} s")
    plain, run = med["python script.py"], med["torchrepro run script.py"]
    print(f"run overhead: +{run - plain:.2f} s ({run / plain:.2f}x)")


if __name__ == "__main__":
    main()
