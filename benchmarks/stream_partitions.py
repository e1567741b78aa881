"""Claim: with ``partitions=P`` and a process group, each of W ranks reads about 1/W of a stream's
samples (its own partitions' shards), where without partitions every rank reads all of them.

Run: ``python benchmarks/stream_partitions.py [--worlds 1,2,4] [--shards 64] [--workers 2] [--epochs 1]``.

One real torchrun launch per world size W (``--standalone``, gloo), both paths side by side in the
same processes, over the same ``--shards`` generated shards (40-80 samples each, unequal):
- partitioned: ``SeededLoader(ds, batch_size=8, global_batch_size=32, drop_last=True,
  shuffle_buffer=256, partitions=4, num_workers=--workers, seed=0)``;
- by-length: the same, the dataset given its shards' lengths (``ShardedDataset(..., lengths=)``),
  so the shards are dealt to the partitions evenly (an epoch ends where a partition runs out:
  the samples received show what that leaves behind);
- unpartitioned (the path without ``partitions=``): the same loader without ``partitions``, where
  every rank reads every shard and keeps its micro-batches of each global batch.
Every process, the loader's workers included, counts the samples its ``read_shard`` generators
yielded (one file per process in a temporary directory, named by rank and pid). Reported per W and
path: the mean and the max over the ranks of the fraction of the dataset's samples that rank read,
their sum over the ranks, and the samples the ranks received in batches together. Target for the
partitioned path: about 1/W per rank (the shards a rank has in flight when the epoch ends are read
in vain, and an epoch ends where its first partition runs out, so it can be a little above or below).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH, GLOBAL, PARTITIONS, BUFFER = 8, 32, 4, 256
PATHS = ("partitioned", "by-length", "unpartitioned")


def length(shard: int) -> int:
    return 40 + (shard * 37) % 41


class CountingReader:
    """``read_shard``: a shard's samples, noting in ``directory/rank{r}-{pid}`` how many it yielded."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, shard: int):  # type: ignore[no-untyped-def]
        import torch

        yielded = 0
        try:
            for offset in range(length(shard)):
                yield {"x": torch.rand(8, 8), "id": shard * 1000 + offset}
                yielded += 1
        finally:
            name = f"rank{os.environ.get('RANK', '0')}-{os.getpid()}"
            with open(Path(self.directory) / name, "a") as f:
                f.write(f"{shard} {yielded}\n")


def child(shards: int, workers: int, epochs: int, reads: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "src"))
    import torchrepro

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    received = {}
    for path in PATHS:
        directory = Path(reads) / path
        if rank == 0:
            directory.mkdir()
        dist.barrier()
        lengths = [length(i) for i in range(shards)] if path == "by-length" else None
        ds = torchrepro.ShardedDataset(range(shards), CountingReader(str(directory)), lengths=lengths)
        extra = {"partitions": PARTITIONS} if path != "unpartitioned" else {}
        loader = torchrepro.SeededLoader(
            ds,
            batch_size=BATCH,
            global_batch_size=GLOBAL,
            drop_last=True,
            shuffle_buffer=BUFFER,
            num_workers=workers,
            seed=0,
            **extra,
        )
        n = 0
        for _ in range(epochs):
            n += sum(len(batch["id"]) for batch in loader)
        received[path] = n
        del loader
        dist.barrier()
    (Path(reads) / f"received-{rank}.json").write_text(json.dumps(received))
    dist.destroy_process_group()


def read_counts(directory: Path, rank: int) -> int:
    total = 0
    for f in directory.glob(f"rank{rank}-*"):
        total += sum(int(line.split()[1]) for line in f.read_text().splitlines() if line)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reads", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.shards, args.workers, args.epochs, args.reads)
        return
    total = sum(length(i) for i in range(args.shards)) * args.epochs
    print(
        f"Samples read per rank / samples in the data ({args.shards} shards, {total} samples in "
        f"{args.epochs} epoch(s)); batch {BATCH}, global batch {GLOBAL}, shuffle_buffer {BUFFER}, "
        f"num_workers={args.workers} (their reads counted), torchrun + gloo; partitioned: "
        f"partitions={PARTITIONS}"
    )
    print(f"{'W':>2} {'path':<14} {'mean/rank':>9} {'max/rank':>9} {'sum/ranks':>9} {'target':>7} received")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for w in (int(x) for x in args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as reads:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={w}"]
            cmd += [__file__, "--child", "--reads", reads, "--shards", str(args.shards)]
            cmd += ["--workers", str(args.workers), "--epochs", str(args.epochs)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"W={w} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            received = [json.loads((Path(reads) / f"received-{r}.json").read_text()) for r in range(w)]
            for path in PATHS:
                fractions = [read_counts(Path(reads) / path, r) / total for r in range(w)]
                target = f"~{1 / w:.3f}" if path != "unpartitioned" else "1.0"
                got = sum(r[path] for r in received)
                print(
                    f"{w:>2} {path:<14} {sum(fractions) / w:9.3f} {max(fractions):9.3f} "
                    f"{sum(fractions):9.3f} {target:>7} {got} samples in batches (all ranks)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
