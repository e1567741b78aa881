"""Claim: ``torchrepro.fingerprint`` hashes float32 tensors at a throughput comparable to
``hashlib.sha256`` over the same bytes, within a small factor of ``tensor.clone()`` (the memory
bandwidth reference), and on a GPU without copying the tensor to the host.

Run: ``python benchmarks/fingerprint_speed.py [--device cpu|cuda] [--sizes-mb 1 4 16 64 256]``.
Prints one row per size with GB/s of each method, measured side by side in one run (the methods
alternate within every repeat, so load on the machine hits all of them alike; median of
``--repeats``), and the ratios fingerprint/sha256 and fingerprint/clone (>1 = fingerprint faster),
each the median of the per-repeat ratios. Target: fingerprint/clone >= 0.6 at 64 MB.
sha256 needs the bytes on the host: for a CUDA tensor its time includes the device-to-host copy.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import time
from collections.abc import Callable

import torch

from torchrepro import fingerprint


def host_bytes(t: torch.Tensor) -> memoryview:
    buf = (ctypes.c_char * t.nbytes).from_address(t.data_ptr())
    return memoryview(buf).cast("B")


def sha256_of(t: torch.Tensor) -> str:
    host = t if t.device.type == "cpu" else t.to("cpu")
    return hashlib.sha256(host_bytes(host.contiguous())).hexdigest()


def alternating_times(
    methods: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Seconds of each method per repeat; within a repeat the methods run one after the other."""
    for fn in methods.values():  # warm up (allocator, lazy initialisation)
        fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"median of {args.repeats} alternating repeats"
    )
    print(f"{'size':>8} {'fingerprint':>12} {'sha256':>10} {'clone':>10} {'fp/sha256':>10} {'fp/clone':>9}")
    for mb in args.sizes_mb:
        t = torch.randn(mb * (1 << 20) // 4, generator=torch.Generator().manual_seed(mb)).to(device)
        gb = t.nbytes / 1e9
        times = alternating_times(
            {
                "fingerprint": lambda t=t: fingerprint(t),
                "sha256": lambda t=t: sha256_of(t),
                "clone": lambda t=t: t.clone(),
            },
            args.repeats,
            sync,
        )
        fp, sha, clone = (statistics.median(times[k]) for k in ("fingerprint", "sha256", "clone"))
        fp_sha = statistics.median(s / f for s, f in zip(times["sha256"], times["fingerprint"], strict=True))
        fp_clone = statistics.median(c / f for c, f in zip(times["clone"], times["fingerprint"], strict=True))
        print(
            f"{mb:>6}MB {gb / fp:>9.2f}GB/s {gb / sha:>7.2f}GB/s {gb / clone:>7.2f}GB/s "
            f"{fp_sha:>9.2f}x {fp_clone:>8.2f}x"
        )
        del t


if __name__ == "__main__":
    main()
