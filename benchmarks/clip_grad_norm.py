"""Measured (no claim yet): what ``torchrepro.clip_grad_norm_`` (one summation order for any
sharding, world size and thread count) costs against ``torch.nn.utils.clip_grad_norm_`` (foreach
norms, then the norm of the norms; its bits depend on how the gradients are split) on one process.

Run: ``python benchmarks/clip_grad_norm.py [--repeats 9] [--threads N] [--norm-type 2]``.

Two gradient sets, float32, filled with seeded normal values: the parameters of a ~25M-parameter
MLP (Linear 1024->4096->4096->1024 with biases) and 1000 small tensors (64x64, 64, 128x32 and
256 elements, in turn). Each repeat runs torch's clip and ours one after the other on the same
gradients (``max_norm`` above the total: both scale by 1.0, so every repeat does the same work);
reported: the median milliseconds of each and the median of the per-repeat ratios ours/torch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from torchrepro import clip_grad_norm_

CASES = {
    "mlp-25M": [(4096, 1024), (4096,), (4096, 4096), (4096,), (1024, 4096), (1024,)],
    "1000-small": [[(64, 64), (64,), (128, 32), (256,)][i % 4] for i in range(1000)],
}


def gradients(shapes: list[tuple[int, ...]], seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = nn.Parameter(torch.empty(shape))
        p.grad = torch.randn(shape, generator=g)
        params.append(p)
    return params


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each function per repeat; within a repeat they run one after the other."""
    for fn in fns.values():  # warm up: allocator, lazy imports
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    parser.add_argument("--norm-type", type=float, default=2.0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    p = args.norm_type
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, threads {threads}, norm_type {p}, median of {args.repeats}")
    print(f"{'case':>12} {'elements':>10} {'torch ms':>9} {'ours ms':>9} {'ours/torch':>10}")
    for case, shapes in CASES.items():
        params = gradients(shapes, seed=0)
        n = sum(q.numel() for q in params)
        times = timed(
            {
                "torch": lambda ps=params: torch.nn.utils.clip_grad_norm_(ps, 1e9, p),
                "ours": lambda ps=params: clip_grad_norm_(ps, 1e9, p),
            },
            args.repeats,
        )
        ratio = statistics.median(o / t for o, t in zip(times["ours"], times["torch"], strict=True))
        ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
        print(f"{case:>12} {n:>10} {ms['torch']:>9.2f} {ms['ours']:>9.2f} {ratio:>9.2f}x")


if __name__ == "__main__":
    main()
