"""Claim: SeededLoader loads an augmenting image dataset at >= 0.95x a plain DataLoader.

Same dataset for both (32x32x3 uint8 images; NumPy reflect-pad + random crop, random flip and
Gaussian noise from NumPy's global RNG, as a plain PyTorch user writes it), num_workers 0 and 2,
runs alternated in one process (order flipped every repeat) so machine load hits both alike.
Workers are persistent and warmed up, so the figures are steady-state samples per second.
Prints samples/s of both, the ratio SeededLoader / DataLoader of the medians, the same ratio
in CPU time (main process + persistent workers, read from /proc: competing processes disturb it
less than wall time), what the per-sample seeding calls cost on their own (the floor of the
overhead: the key, plus seeding torch's RNG and those the dataset draws from, here NumPy's;
SeededLoader stops seeding Python's per sample once a process sees the dataset never draws from
it, and checks after every batch) and the ratio that floor
alone allows (ceiling).

    python benchmarks/loader_throughput.py [--samples 4096] [--batch-size 64] [--repeats 11]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import torchrepro


class AugmentedImages(Dataset[tuple[torch.Tensor, int]]):
    """CIFAR-shaped images with the usual augmentation, drawn from NumPy's global RNG."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.images = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
        self.labels = rng.integers(0, 10, size=n).tolist()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        padded = np.pad(self.images[index], ((4, 4), (4, 4), (0, 0)), mode="reflect")
        y, x = np.random.randint(0, 9, size=2)
        image = padded[y : y + 32, x : x + 32]
        if np.random.rand() < 0.5:
            image = image[:, ::-1]
        out = image.astype(np.float32) * (1.0 / 255.0)
        out += np.random.normal(0.0, 0.05, size=out.shape).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1))), self.labels[index]


def _worker_cpu_s(loader: Any) -> float:
    """CPU seconds the loader's persistent worker processes have run so far (Linux schedstat)."""
    iterator = getattr(loader, "_iterator", None)
    total = 0.0
    for worker in getattr(iterator, "_workers", ()):
        try:
            with open(f"/proc/{worker.pid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            return math.nan  # not Linux: no worker CPU figure
    return total


def one_pass(loader: Any) -> tuple[float, float]:
    """Samples per second of one full pass: wall clock, and CPU time of this process + workers.

    CPU time is the figure that other processes competing for the cores disturb least.
    """
    samples = 0
    start, cpu, workers = time.perf_counter(), time.process_time(), _worker_cpu_s(loader)
    for images, _ in loader:
        samples += len(images)
    cpu_s = time.process_time() - cpu + _worker_cpu_s(loader) - workers
    return samples / (time.perf_counter() - start), samples / cpu_s


def lockstep(loaders: list[tuple[str, Any]], repeats: int) -> dict[str, tuple[float, float]]:
    """Samples per second of loaders without workers, batch by batch in lockstep: one batch of
    each in turn (the order rotating), every batch timed alone; the figure is the median batch,
    in wall clock and in CPU time. A burst of load on the machine hits the three alike and spoils
    a few batches instead of a whole pass (repeated passes of one loader after another moved the
    ratio by +-5% here)."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in loaders}
    clock, cpu_clock = time.perf_counter, time.process_time
    for _ in range(repeats):
        iterators = [(name, iter(loader)) for name, loader in loaders]
        step = 0
        while iterators:
            shift = step % len(iterators)
            for name, iterator in iterators[shift:] + iterators[:shift]:
                start, cpu = clock(), cpu_clock()
                batch = next(iterator, None)
                if batch is None:
                    iterators = [entry for entry in iterators if entry[0] != name]
                    continue
                times[name].append((len(batch[0]) / (clock() - start), len(batch[0]) / (cpu_clock() - cpu)))
            step += 1
    return {
        name: (statistics.median(t[0] for t in rows), statistics.median(t[1] for t in rows))
        for name, rows in times.items()
    }


def seeding_cost_us() -> dict[str, float]:
    """CPU microseconds per sample of each per-sample seeding call (best of several runs)."""
    from torchrepro.seeding import NUMPY_RNG, TORCH_RNG, Deriver, _CRandom, sample_seeder

    derive = Deriver(0, ("sample", 0), 3)
    seed_globals = sample_seeder(np)
    seed_drawn = sample_seeder(np, NUMPY_RNG | TORCH_RNG)  # what this dataset draws from
    c_seed = _CRandom.seed.__get__(random._inst)  # type: ignore[attr-defined]
    calls = {
        "key": lambda i: derive.one(i),
        "python": lambda i: c_seed(i * 0x9E3779B97F4A7C15),
        "numpy": lambda i: np.random.seed(i),
        "torch": lambda i: torch.default_generator.manual_seed(i),
        "all three": lambda i: seed_globals(derive.one(i)),
        "together": lambda i: seed_drawn(derive.one(i)),
    }
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    best = {}
    for name, call in calls.items():
        times = []
        for _ in range(7):
            start = time.process_time()
            for i in range(2000):
                call(i)
            times.append((time.process_time() - start) / 2000 * 1e6)
        best[name] = min(times)
    random.setstate(state[0]), np.random.set_state(state[1]), torch.set_rng_state(state[2])
    return best


def state_saving_cost_us() -> dict[str, float]:
    """CPU microseconds per batch to save and put back NumPy's global RNG state in the main
    process: as SeededLoader does it (raw bytes) and through NumPy's API (best of several runs)."""
    from torchrepro.data.rawrng import numpy_mt

    def raw() -> None:
        numpy_mt.restore(np, numpy_mt.save(np))

    def api() -> None:
        np.random.set_state(np.random.get_state())

    best = {}
    for name, call in (("SeededLoader", raw), ("NumPy API", api)):
        times = []
        for _ in range(7):
            start = time.process_time()
            for _ in range(500):
                call()
            times.append((time.process_time() - start) / 500 * 1e6)
        best[name] = min(times)
    return best


class BareSeeding(Dataset[Any]):
    """The per-sample seeding alone, as cheap as it gets: NumPy's global RNG (and torch's, with
    ``torch_too``) seeded from the sample's key before each sample (keys derived per batch),
    nothing else (no state put back, no sampler of keys, no check of which RNGs are drawn). Its
    throughput is the ceiling of any loader that keys those RNGs per sample, measured in place:
    between real samples the seeding calls cost more than in a hot loop (cold caches, and the
    Mersenne Twister a seed starts is regenerated at the first draw). NumPy alone is the ceiling
    even for a loader that seeded only the RNGs a dataset draws from (this one draws from NumPy's);
    SeededLoader also seeds torch's for every sample: a dataset may read ``torch.initial_seed()``
    without drawing, which no check could see."""

    def __init__(self, dataset: Dataset[Any], *, torch_too: bool) -> None:
        from torchrepro.seeding import Deriver

        self.dataset = dataset
        self.derive = Deriver(0, ("sample", 0), 3)
        self.torch_too = torch_too

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        np_seed, torch_seed, dataset = np.random.seed, torch.default_generator.manual_seed, self.dataset
        samples = []
        for index, seed in zip(indices, self.derive.many(indices), strict=True):
            np_seed(seed >> 32)
            if self.torch_too:
                torch_seed(seed)
            samples.append(dataset[index])
        return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()

    dataset = AugmentedImages(args.samples)
    cost = seeding_cost_us()
    floor = cost.pop("together")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.samples} samples, "
        f"batch {args.batch_size}, {args.repeats} repeats (median); num_workers 0: batches in "
        "lockstep, 2: whole passes in rotating order"
    )
    header = (
        "num_workers",
        "DataLoader",
        "SeededLoader",
        "ratio",
        "CPU ratio",
        "CPU us/sample",
        "bare",
        "np only",
    )
    print("{:>11}  {:>14}  {:>14}  {:>6}  {:>9}  {:>15}  {:>5}  {:>7}".format(*header))
    ratios = []
    for num_workers in (0, 2):
        extra: dict[str, Any] = {"persistent_workers": True} if num_workers else {}
        plain, bare, np_only = (
            DataLoader(
                source,
                batch_size=args.batch_size,
                shuffle=True,
                num_workers=num_workers,
                generator=torch.Generator().manual_seed(0),
                **extra,
            )
            for source in (
                dataset,
                BareSeeding(dataset, torch_too=True),
                BareSeeding(dataset, torch_too=False),
            )
        )
        seeded = torchrepro.SeededLoader(
            dataset, batch_size=args.batch_size, seed=0, num_workers=num_workers, **extra
        )
        loaders = [("plain", plain), ("seeded", seeded), ("bare", bare), ("np only", np_only)]
        for _, loader in loaders:
            one_pass(loader)  # warm up (start persistent workers, caches)
        if num_workers == 0:
            medians = lockstep(loaders, args.repeats)
            wall = {name: rate[0] for name, rate in medians.items()}
            cpu = {name: rate[1] for name, rate in medians.items()}
        else:  # workers prefetch: only whole passes measure throughput
            rates: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in loaders}
            for repeat in range(args.repeats):
                shift = repeat % len(loaders)  # each loader runs first, second and last alike
                for name, loader in loaders[shift:] + loaders[:shift]:
                    rates[name].append(one_pass(loader))
            wall = {name: statistics.median(r[0] for r in rates[name]) for name in rates}
            cpu = {name: statistics.median(r[1] for r in rates[name]) for name in rates}
        ratio = wall["seeded"] / wall["plain"]
        ratios.append(ratio)
        plain_us, seeded_us = 1e6 / cpu["plain"], 1e6 / cpu["seeded"]
        print(
            f"{num_workers:>11}  {wall['plain']:>10.0f} s/s  {wall['seeded']:>10.0f} s/s  {ratio:>6.3f}  "
            f"{cpu['seeded'] / cpu['plain']:>9.3f}  {plain_us:>6.1f} -> {seeded_us:>5.1f}  "
            f"{wall['bare'] / wall['plain']:>5.3f}  {wall['np only'] / wall['plain']:>7.3f}"
        )
        del (
            plain,
            seeded,
            bare,
            np_only,
            loaders,
        )  # shut persistent workers down before the next configuration
    parts = ", ".join(f"{name} {us:.1f}" for name, us in cost.items())
    print(f"per-sample seeding cost in a hot loop (CPU us): {floor:.1f} as SeededLoader calls it ({parts})")
    print(
        "bare / np only: a DataLoader whose dataset only seeds NumPy and torch / NumPy alone per "
        "sample (BareSeeding), over DataLoader: the ceilings of per-sample seeding, measured "
        "between real samples"
    )
    saving = state_saving_cost_us()
    print(
        "per-batch NumPy state save + restore in the main process (CPU us): "
        + ", ".join(f"{name} {us:.1f}" for name, us in saving.items())
    )
    print(f"target ratio >= 0.95: {'met' if min(ratios) >= 0.95 else 'NOT met'} (min {min(ratios):.3f})")


if __name__ == "__main__":
    main()
