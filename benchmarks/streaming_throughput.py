"""Claim: streaming a ShardedDataset through SeededLoader keeps >= 0.95 of a plain DataLoader's
throughput over the same IterableDataset (per-sample cost about 50-200 us) at num_workers 0 and 2,
and a resume in an epoch's second half reaches its first batch far sooner than reading the epoch
from its start.

Run: ``python benchmarks/streaming_throughput.py [--shards 100] [--samples 50] [--cost-us 100] [--rounds 3]``.

Side by side in one process, interleaved round by round, over the same generated shards:
- plain: ``DataLoader(ShardedDataset(...), batch_size=32, num_workers=n)``, the stock path for a
  streaming dataset (each worker reads every n-th shard, unseeded, no shuffle);
- seeded: ``SeededLoader(ShardedDataset(...), batch_size=32, seed=0, num_workers=n,
  shuffle_buffer=1000)`` (shards in a keyed order, every sample seeded, the keyed shuffle buffer,
  collate seeded per batch in the main process).
``read_shard`` spends ``--cost-us`` per sample (a NumPy augmentation plus a busy wait) and draws
from torch's and NumPy's global RNGs. Reported: samples per second of each, their ratio (median
over rounds), and for the resume: seconds to the first batch after ``load_state_dict`` of a
position 70% into the epoch, against seconds to reach that batch by iterating from the start.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torchrepro

COST_S = 100e-6
SAMPLES = 50


def read_shard(shard: int, start: int = 0):
    for offset in range(start, SAMPLES + shard % 7):
        t0 = time.perf_counter()
        image = np.random.rand(8, 8).astype(np.float32) + torch.rand(()).item()
        while time.perf_counter() - t0 < COST_S:
            pass
        yield {"x": torch.from_numpy(image), "id": shard * 1000 + offset}


def throughput(loader) -> float:
    start = time.perf_counter()
    n = sum(len(batch["id"]) for batch in loader)
    return n / (time.perf_counter() - start)


def main() -> None:
    global COST_S, SAMPLES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--cost-us", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    COST_S, SAMPLES = args.cost_us * 1e-6, args.samples
    ds = torchrepro.ShardedDataset(range(args.shards), read_shard)
    for workers in (0, 2):
        plain_rates, seeded_rates = [], []
        kwargs = {"num_workers": workers, "persistent_workers": workers > 0}
        plain = DataLoader(ds, batch_size=32, **kwargs)
        seeded = torchrepro.SeededLoader(ds, batch_size=32, seed=0, shuffle_buffer=1000, **kwargs)
        throughput(plain), throughput(seeded)  # warm-up (workers start)
        for _ in range(args.rounds):
            plain_rates.append(throughput(plain))
            seeded_rates.append(throughput(seeded))
        p, s = statistics.median(plain_rates), statistics.median(seeded_rates)
        print(
            f"num_workers={workers}: plain DataLoader {p:8.0f} samples/s, SeededLoader {s:8.0f} samples/s, "
            f"ratio {s / p:.3f} (target >= 0.95)"
        )
    # Resume 70% into an epoch: time to the first batch, against reading up to it.
    loader = torchrepro.SeededLoader(ds, batch_size=32, seed=0, shuffle_buffer=1000)
    total = sum(len(b["id"]) for b in loader)
    target = int(total * 0.7) // 32
    saver = torchrepro.SeededLoader(ds, batch_size=32, seed=0, shuffle_buffer=1000)
    start = time.perf_counter()
    it = iter(saver)
    for _ in range(target + 1):
        next(it)
    from_start = time.perf_counter() - start
    state = saver.state_dict()
    saver2 = torchrepro.SeededLoader(ds, batch_size=32, seed=0, shuffle_buffer=1000)
    it2 = iter(saver2)
    for _ in range(target):
        next(it2)
    state = saver2.state_dict()
    resumed = torchrepro.SeededLoader(ds, batch_size=32, seed=0, shuffle_buffer=1000)
    start = time.perf_counter()
    resumed.load_state_dict(state)
    first = next(iter(resumed))
    to_first = time.perf_counter() - start
    assert first["id"].tolist() == next(it2)["id"].tolist()
    print(
        f"resume at batch {target} of {total // 32 + 1} ({args.shards} shards): first batch after "
        f"{to_first:.3f} s, reading the epoch up to it {from_start:.3f} s "
        f"({from_start / to_first:.1f}x sooner)"
    )


if __name__ == "__main__":
    main()
