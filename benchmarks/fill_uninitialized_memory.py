"""Claim: ``torch.utils.deterministic.fill_uninitialized_memory`` (on in strict mode) costs little
on a training step, and its worst case is an allocation-bound loop.

Run: ``python benchmarks/fill_uninitialized_memory.py [--device cpu|cuda] [--repeats N]``.
With ``torchrepro.set_determinism("strict")`` in force (the fill only acts when deterministic
algorithms are on), each workload is timed with the fill on and off, interleaved, and the best
and median times and the ratios on/off are printed side by side (ratio > 1: the fill costs that
much; on a shared machine trust the best-of ratio more):

- ``cnn_step``: forward + backward + SGD step of a small CNN with dropout (batch 32, 3x32x32);
- ``mlp_step``: the same for a 3-layer MLP (batch 256, 1024-2048-2048-10), big activations;
- ``empty_heavy``: 20x ``torch.empty`` of 16 MB plus an ``add_`` into it (allocation bound:
  without the fill, ``empty`` costs almost nothing, so this is the worst case).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import torchrepro


def cnn_step(device: torch.device) -> Callable[[], None]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.25),
        nn.Linear(64 * 16 * 16, 10),
    ).to(device)
    return _step(model, torch.randn(32, 3, 32, 32, device=device), device)


def mlp_step(device: torch.device) -> Callable[[], None]:
    model = nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
    ).to(device)
    return _step(model, torch.randn(256, 1024, device=device), device)


def _step(model: nn.Module, x: torch.Tensor, device: torch.device) -> Callable[[], None]:
    y = torch.randint(0, 10, (x.shape[0],), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def empty_heavy(device: torch.device) -> Callable[[], None]:
    one = torch.ones(4 * 2**20, device=device)

    def run() -> None:
        for _ in range(20):
            torch.empty(4 * 2**20, device=device).add_(one)

    return run


def timed(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def set_fill(on: bool) -> None:
    torch.utils.deterministic.fill_uninitialized_memory = on  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    previous = torchrepro.set_determinism("strict")
    try:
        print(
            f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
            f"{args.repeats} interleaved runs each"
        )
        print(
            f"{'workload':<12} {'best on/off (ms)':>18} {'ratio':>6} {'median on/off (ms)':>20} {'ratio':>6}"
        )
        for name, make in (("cnn_step", cnn_step), ("mlp_step", mlp_step), ("empty_heavy", empty_heavy)):
            torch.manual_seed(0)
            fn = make(device)
            for on in (True, False):  # warm up both paths
                set_fill(on)
                fn()
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.repeats):
                for on in (True, False):
                    set_fill(on)
                    times[on].append(timed(fn, sync))
            b_on, b_off = min(times[True]) * 1e3, min(times[False]) * 1e3
            m_on, m_off = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
            print(
                f"{name:<12} {b_on:8.2f} /{b_off:8.2f} {b_on / b_off:5.2f}x "
                f"{m_on:9.2f} /{m_off:9.2f} {m_on / m_off:5.2f}x"
            )
    finally:
        previous.restore()


if __name__ == "__main__":
    main()
