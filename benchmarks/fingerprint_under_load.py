"""Claim: on a machine whose cores are busy, ``torchrepro.fingerprint`` of a large CPU tensor keeps
at least its single-threaded throughput (it used to fall far below it: torch's intra-op threads
wait for each other in every op of every chunk while other processes hold the cores).

Run: ``python benchmarks/fingerprint_under_load.py [--busy N] [--mb 64] [--repeats 9]``.

The load is made here: ``--busy`` processes (default: one per core) spin in pure Python while
the load figures are taken. Side by side in one run, the methods alternating within every repeat
(median GB/s of ``--repeats``), quiet and then loaded:
- ``fingerprint``: as shipped (the thread count measured faster so far, ``hashing._ThreadChoice``);
- ``all threads``: the same hashing always with torch's thread count (the behaviour before);
- ``one thread``: the same hashing with ``torch.set_num_threads(1)``;
- ``sha256``: ``hashlib.sha256`` over the same bytes (single-threaded, a reference).
Target: loaded ``fingerprint`` >= loaded ``one thread`` x 0.9 (noise), and quiet figures kept.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable

import torch

from torchrepro import fingerprint, hashing


def _spin(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    x = 0
    while not stop.is_set():
        x += 1


def _sha256(t: torch.Tensor) -> None:
    hashlib.sha256(memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")).digest()


def _methods(t: torch.Tensor) -> dict[str, Callable[[], object]]:
    threads = torch.get_num_threads()
    choice = hashing._thread_choice

    def forced(n: int) -> Callable[[], object]:
        def run() -> object:
            pick = choice.pick
            choice.pick = lambda _threads: n  # type: ignore[method-assign]
            try:
                return fingerprint(t)
            finally:
                choice.pick = pick  # type: ignore[method-assign]

        return run

    return {
        "fingerprint": lambda: fingerprint(t),
        "all threads": forced(threads),
        "one thread": forced(1),
        "sha256": lambda: _sha256(t),
    }


def _rates(t: torch.Tensor, repeats: int) -> dict[str, float]:
    methods = _methods(t)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(repeats):
        order = list(methods) if r % 2 == 0 else list(methods)[::-1]
        for name in order:
            start = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - start)
    return {name: t.nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--busy", type=int, default=os.cpu_count() or 2, help="busy processes (default: cores)"
    )
    parser.add_argument("--mb", type=int, default=64, help="tensor size in MB (float32)")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    t = torch.randn(args.mb * 2**18)
    fingerprint(t)  # warm up: scratch buffers, the first measurements of the thread choice
    quiet = _rates(t, args.repeats)
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    try:
        loaded = _rates(t, args.repeats)
    finally:
        stop.set()
        for p in procs:
            p.join()
    print(
        f"fingerprint of {args.mb} MB float32, torch threads {torch.get_num_threads()}, "
        f"{os.cpu_count()} cores, {args.busy} busy processes for 'loaded' (median of {args.repeats}, GB/s)"
    )
    print(f"{'method':>12} {'quiet':>8} {'loaded':>8}")
    for name in quiet:
        print(f"{name:>12} {quiet[name]:8.2f} {loaded[name]:8.2f}")
    print(
        f"loaded fingerprint / one thread: {loaded['fingerprint'] / loaded['one thread']:.2f}x "
        f"(target >= 0.9); / all threads (before): {loaded['fingerprint'] / loaded['all threads']:.2f}x; "
        f"quiet fingerprint / all threads: {quiet['fingerprint'] / quiet['all threads']:.2f}x"
    )


if __name__ == "__main__":
    main()
