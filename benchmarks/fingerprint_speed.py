"""Claim: ``torchrepro.fingerprint`` hashes float32 tensors at a throughput comparable to
``hashlib.sha256`` over the same bytes, within a small factor of ``tensor.clone()`` (the memory
bandwidth reference), and on a GPU without copying the tensor to the host.

Run: ``python benchmarks/fingerprint_speed.py [--device cpu|cuda] [--sizes-mb 1 4 16 64 256]``.
Prints one row per size with GB/s of each method, measured side by side in one run (best of
``--repeats``), and the ratios fingerprint/sha256 and fingerprint/clone (>1 = fingerprint faster).
sha256 needs the bytes on the host: for a CUDA tensor its time includes the device-to-host copy.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
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


def best_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm up (allocator, lazy initialisation)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"best of {args.repeats}"
    )
    print(f"{'size':>8} {'fingerprint':>12} {'sha256':>10} {'clone':>10} {'fp/sha256':>10} {'fp/clone':>9}")
    for mb in args.sizes_mb:
        t = torch.randn(mb * (1 << 20) // 4, generator=torch.Generator().manual_seed(mb)).to(device)
        gb = t.nbytes / 1e9
        fp = best_time(lambda t=t: fingerprint(t), args.repeats, sync)
        sha = best_time(lambda t=t: sha256_of(t), args.repeats, sync)
        clone = best_time(lambda t=t: t.clone(), args.repeats, sync)
        print(
            f"{mb:>6}MB {gb / fp:>9.2f}GB/s {gb / sha:>7.2f}GB/s {gb / clone:>7.2f}GB/s "
            f"{sha / fp:>9.2f}x {clone / fp:>8.2f}x"
        )
        del t


if __name__ == "__main__":
    main()
