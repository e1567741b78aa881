"""Claim: streaming a ShardedDataset through SeededLoader keeps >= 0.95 of a plain DataLoader's
throughput over the same IterableDataset (per-sample cost about 50-200 us) at num_workers 0 and 2,
and a resume in an epoch's second half reaches its first batch far sooner than reading the epoch
from its start. The partitioned stream (``partitions=4``, one process), unpacked and packed, keeps
>= 0.95 of the plain DataLoader's throughput at num_workers 0 and >= 1.0 at 2, and resumes (with a
filter, with packing) sooner than reading up to the position.

Run: ``python benchmarks/streaming_throughput.py [--shards 100] [--samples 50] [--cost-us 100]
[--rounds 3] [--seq-len 128] [--profile]``.

Side by side in one process, interleaved round by round, over the same generated shards:
- plain: ``DataLoader(ShardedDataset(...), batch_size=32, num_workers=n)``, the stock path for a
  streaming dataset (each worker reads every n-th shard, unseeded, no shuffle);
- seeded: ``SeededLoader(ShardedDataset(...), batch_size=32, seed=0, num_workers=n,
  shuffle_buffer=1000)`` (shards in a keyed order, every sample seeded, the keyed shuffle buffer,
  collate seeded per batch in the main process);
- partitioned: the seeded loader with ``partitions=4, global_batch_size=32, drop_last=True`` and
  ``shuffle_buffer=250`` (each partition has a buffer of its own: 1000 samples held in all, as
  above), against the same plain loader;
- packed: documents (``read_doc``: ``{"input_ids": list of 16-255 ints, "id"}``, the same
  per-document cost, no RNG draws) through ``ds.pack(--seq-len)`` and the partitioned loader, against
  the stock path for a packed stream: a plain ``DataLoader`` over the same packed
  ``ShardedDataset``, whose ``__iter__`` concatenates each worker's documents and cuts blocks
  (unseeded, unshuffled; the same three fields). Throughput in blocks of ``--seq-len`` tokens.
``read_shard`` spends ``--cost-us`` per sample (a NumPy augmentation plus a busy wait) and draws
from torch's and NumPy's global RNGs. Reported: samples per second of each, their ratio (median
over rounds; for the new rows also the median of each round's ratio, the loaders of a round having
run back to back under the same load), and for the resume: seconds to the first batch after
``load_state_dict`` of a position 70% into the epoch, against seconds to reach that batch by
iterating from the start, and the samples (documents) each read, at num_workers 0: unpartitioned;
partitioned; partitioned with a filter keeping 80% by ``sample_rng()``; partitioned and packed;
then the unpartitioned, filtered and packed streams again with ``shuffle_buffer=1`` (what the
resume itself reads, with no shuffle window to refill). ``--profile``: cProfile of the main
process over one pass of each loader at num_workers 0, the top functions by their own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torchrepro

COST_S = 100e-6
SAMPLES = 50
BATCH = 32
BUFFER = 1000
PARTITIONS = 4
READ = [0]  # samples the read functions yielded in this process


def read_shard(shard: int, start: int = 0):
    for offset in range(start, SAMPLES + shard % 7):
        t0 = time.perf_counter()
        image = np.random.rand(8, 8).astype(np.float32) + torch.rand(()).item()
        while time.perf_counter() - t0 < COST_S:
            pass
        READ[0] += 1
        yield {"x": torch.from_numpy(image), "id": shard * 1000 + offset}


def read_doc(shard: int, start: int = 0):
    """Documents of 16-255 tokens (a function of shard and offset), ``COST_S`` each (tokenizing)."""
    for offset in range(start, SAMPLES + shard % 7):
        t0 = time.perf_counter()
        n = 16 + (shard * 7919 + offset * 104729) % 240
        ids = [(shard * 131 + offset * 17 + j) % 50_000 for j in range(n)]
        while time.perf_counter() - t0 < COST_S:
            pass
        READ[0] += 1
        yield {"input_ids": ids, "id": shard * 1000 + offset}


def keep(sample: Any) -> bool:
    """About 80% of the samples, by a draw keyed to each."""
    return float(torchrepro.sample_rng().random()) < 0.8


def units(batch: dict[str, Any]) -> int:
    return len(next(iter(batch.values())))


def throughput(loader) -> float:
    start = time.perf_counter()
    n = sum(units(batch) for batch in loader)
    return n / (time.perf_counter() - start)


def seeded(ds: torchrepro.ShardedDataset, **kwargs: Any) -> torchrepro.SeededLoader:
    return torchrepro.SeededLoader(ds, batch_size=BATCH, seed=0, shuffle_buffer=BUFFER, **kwargs)


def partitioned(
    ds: torchrepro.ShardedDataset, shuffle_buffer: int = BUFFER // PARTITIONS, **kwargs: Any
) -> torchrepro.SeededLoader:
    return torchrepro.SeededLoader(
        ds,
        batch_size=BATCH,
        global_batch_size=BATCH,
        drop_last=True,
        partitions=PARTITIONS,
        seed=0,
        shuffle_buffer=shuffle_buffer,
        **kwargs,
    )


def ratio(rates: dict[str, list[float]], name: str, base: str) -> str:
    """The ratio of the medians, and the median of the rounds' ratios (each round's loaders ran
    back to back, under the same load)."""
    medians = statistics.median(rates[name]) / statistics.median(rates[base])
    per_round = statistics.median(a / b for a, b in zip(rates[name], rates[base], strict=True))
    return f"ratio {medians:.3f} (per-round median {per_round:.3f})"


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def resume(make: Callable[[], torchrepro.SeededLoader]) -> tuple[int, int, float, float, int, int]:
    """Batches in the epoch, the batch 70% in, seconds to it after ``load_state_dict``, seconds
    to it reading from the start, and the samples each of the two read (num_workers=0)."""
    batches = sum(1 for _ in make())
    target = int(batches * 0.7)
    saver = make()
    READ[0] = 0
    start = time.perf_counter()
    it = iter(saver)
    for _ in range(target):
        next(it)
    state = saver.state_dict()
    expected = next(it)
    from_start = time.perf_counter() - start
    read_from_start = READ[0]
    resumed = make()
    READ[0] = 0
    start = time.perf_counter()
    resumed.load_state_dict(state)
    first = next(iter(resumed))
    to_first = time.perf_counter() - start
    assert same(first, expected), "the resumed loader's first batch differs"
    return batches, target, to_first, from_start, READ[0], read_from_start


def profile(name: str, loader, top: int = 16) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    n = sum(units(batch) for batch in loader)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    print(f"\n--- cProfile, main process, num_workers=0: {name} ({n} units, {stats.total_tt:.2f} s) ---")
    stats.sort_stats("tottime").print_stats(top)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    print("\n".join(line for line in lines[start:] if line.strip()))


def main() -> None:
    global COST_S, SAMPLES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--cost-us", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="cProfile one pass of each loader")
    args = parser.parse_args()
    COST_S, SAMPLES = args.cost_us * 1e-6, args.samples
    ds = torchrepro.ShardedDataset(range(args.shards), read_shard)
    docs = torchrepro.ShardedDataset(range(args.shards), read_doc).pack(args.seq_len)
    for workers in (0, 2):
        kwargs = {"num_workers": workers, "persistent_workers": workers > 0}
        loaders = {
            "plain": DataLoader(ds, batch_size=BATCH, **kwargs),
            "seeded": seeded(ds, **kwargs),
            "partitioned": partitioned(ds, **kwargs),
            "plain packed": DataLoader(docs, batch_size=BATCH, **kwargs),
            "packed": partitioned(docs, **kwargs),
        }
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        for loader in loaders.values():
            throughput(loader)  # warm-up (workers start)
        for _ in range(args.rounds):
            for name, loader in loaders.items():
                rates[name].append(throughput(loader))
        r = {name: statistics.median(v) for name, v in rates.items()}
        p, s = r["plain"], r["seeded"]
        print(
            f"num_workers={workers}: plain DataLoader {p:8.0f} samples/s, SeededLoader {s:8.0f} samples/s, "
            f"ratio {s / p:.3f} (target >= 0.95)"
        )
        target = 0.95 if workers == 0 else 1.0
        print(
            f"num_workers={workers}: plain DataLoader {p:8.0f} samples/s, partitions={PARTITIONS} "
            f"{r['partitioned']:8.0f} samples/s, {ratio(rates, 'partitioned', 'plain')} "
            f"(target >= {target}); "
            f"against SeededLoader {ratio(rates, 'partitioned', 'seeded')}"
        )
        print(
            f"num_workers={workers}: plain DataLoader, packed {r['plain packed']:8.0f} blocks/s, "
            f"partitions={PARTITIONS} packed {r['packed']:8.0f} blocks/s, "
            f"{ratio(rates, 'packed', 'plain packed')} "
            f"(target >= {target}; blocks of {args.seq_len} tokens)",
            flush=True,
        )
        del loaders
    # Resume 70% into an epoch: time to the first batch, against reading up to it. The partitioned
    # rows hold BUFFER samples in all (BUFFER // PARTITIONS per partition), then none (the reads
    # the resume itself needs, without a shuffle buffer's window to refill).
    per_partition = BUFFER // PARTITIONS
    rows: list[tuple[str, Callable[[], torchrepro.SeededLoader]]] = [
        (f"{args.shards} shards", lambda: seeded(ds)),
        (f"partitions={PARTITIONS}, shuffle_buffer={per_partition}", lambda: partitioned(ds)),
        (
            f"partitions={PARTITIONS}, filter, shuffle_buffer={per_partition}",
            lambda: partitioned(ds.filter(keep)),
        ),
        (
            f"partitions={PARTITIONS}, pack({args.seq_len}), shuffle_buffer={per_partition}",
            lambda: partitioned(docs),
        ),
        (
            "no partitions, shuffle_buffer=1",
            lambda: torchrepro.SeededLoader(ds, batch_size=BATCH, seed=0, shuffle_buffer=1),
        ),
        (f"partitions={PARTITIONS}, filter, shuffle_buffer=1", lambda: partitioned(ds.filter(keep), 1)),
        (f"partitions={PARTITIONS}, pack({args.seq_len}), shuffle_buffer=1", lambda: partitioned(docs, 1)),
    ]
    for label, make in rows:
        batches, target, to_first, from_start, read, read_from_start = resume(make)
        print(
            f"resume at batch {target} of {batches} ({label}): first batch after "
            f"{to_first:.3f} s, reading the epoch up to it {from_start:.3f} s "
            f"({from_start / to_first:.1f}x sooner; samples read {read} against {read_from_start})",
            flush=True,
        )
    if args.profile:
        profile("plain DataLoader", DataLoader(ds, batch_size=BATCH))
        profile(f"partitions={PARTITIONS}", partitioned(ds))
        profile("plain DataLoader, packed", DataLoader(docs, batch_size=BATCH))
        profile(f"partitions={PARTITIONS}, packed", partitioned(docs))


if __name__ == "__main__":
    main()
