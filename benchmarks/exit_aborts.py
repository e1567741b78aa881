"""Claim: ranks that ``torchrepro run --nproc 2`` starts never abort at exit and never lose a file the
script left open, where plain ``torchrun`` aborts some ranks (torch's gloo exit race,
pytorch#190489; see ``src/torchrepro/_child/teardown.py``) and loses those ranks' files with them.

Run: ``python benchmarks/exit_aborts.py [--runs 40] [--late-runs 10] [--parallel 3]``.

Two 2-rank scripts, each launched ``--runs`` times by each launcher, interleaved, ``--parallel``
launches at a time so that the 2 cores are loaded as in a busy CI machine:
- ``ddp``: a DDP training that keeps a gzip log and a zip archive open and ends right after its last
  ``backward()`` (the race as users meet it: rare, more frequent under load);
- ``late``: ``tests/e2e/exit_scripts/open_files.py --late``, which provokes the race (most plain
  launches abort).
Counted per launcher and script: launches with a rank that aborted (SIGABRT, "terminate called
without an active exception") and launches where a rank's gzip log or zip archive is unreadable.
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LATE = ROOT / "tests" / "e2e" / "exit_scripts" / "open_files.py"
DDP = """
import gzip, zipfile
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
log = gzip.open(f"log.rank{rank}.gz", "wt")
archive = zipfile.ZipFile(f"archive.rank{rank}.zip", "w")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    optimizer.zero_grad()
    loss = model(torch.full((2, 4), float(step + rank))).pow(2).mean()
    log.write(f"step {step} loss {loss.item():.6f}\\n")
    archive.writestr(f"step{step}.txt", f"{loss.item():.6f}")
    loss.backward()
    optimizer.step()
"""


def intact(directory: Path) -> bool:
    """Whether both ranks' gzip logs hold their 3 lines and both zip archives their 3 entries."""
    try:
        for rank in (0, 1):
            with gzip.open(directory / f"log.rank{rank}.gz", "rt") as f:
                if len(f.read().splitlines()) != 3:
                    return False
            with zipfile.ZipFile(directory / f"archive.rank{rank}.zip") as z:
                if len(z.namelist()) != 3:
                    return False
    except (OSError, EOFError, zipfile.BadZipFile):
        return False
    return True


def launch(launcher: str, script: Path, args: list[str], directory: Path, port: int) -> tuple[bool, bool]:
    """One 2-rank launch in ``directory``: (a rank aborted, the files are intact)."""
    directory.mkdir(parents=True)
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        command += ["--master-port", str(port), str(script), *args]
    else:
        command = [sys.executable, "-m", "torchrepro", "run", "--mode", "off", "--nproc", "2"]
        command += [str(script), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("TORCHREPRO_")}
    proc = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=600)
    aborted = "terminate called without an active exception" in proc.stderr or "SIGABRT" in proc.stderr
    return aborted, intact(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="launches of the ddp script per launcher")
    parser.add_argument("--late-runs", type=int, default=10, help="launches of the late script per launcher")
    parser.add_argument("--parallel", type=int, default=3, help="launches at a time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ddp = Path(tmp) / "ddp_open_files.py"
        ddp.write_text(DDP, encoding="utf-8")
        jobs = []
        scripts = (("ddp", ddp, [], args.runs), ("late", LATE, ["--late"], args.late_runs))
        for name, script, extra, runs in scripts:
            for i in range(runs):
                for launcher in ("torchrun", "torchrepro run"):
                    where = Path(tmp) / f"{name}-{launcher.replace(' ', '-')}-{i}"
                    jobs.append((name, launcher, script, extra, where))
        with ThreadPoolExecutor(args.parallel) as pool:
            futures = [
                (name, launcher, pool.submit(launch, launcher, script, extra, where, 29000 + n))
                for n, (name, launcher, script, extra, where) in enumerate(jobs)
            ]
            counts: dict[tuple[str, str], list[int]] = {}
            for name, launcher, future in futures:
                aborted, whole = future.result()
                row = counts.setdefault((name, launcher), [0, 0, 0])
                row[0] += 1
                row[1] += aborted
                row[2] += not whole
    print(f"{'script':<6} {'launcher':<15} {'launches':>8} {'aborted':>8} {'files lost':>10}")
    for (name, launcher), (runs, aborted, lost) in counts.items():
        print(f"{name:<6} {launcher:<15} {runs:>8} {aborted:>8} {lost:>10}")
    for name in ("ddp", "late"):
        plain, ours = counts[name, "torchrun"], counts[name, "torchrepro run"]
        print(
            f"{name}: aborted launches, torchrepro run / torchrun = {ours[1]}/{plain[1]}; "
            f"files lost = {ours[2]}/{plain[2]} (of {plain[0]} launches each)"
        )


if __name__ == "__main__":
    main()
