"""Claim: tracing one training step with exact op digests costs at most 2x the untraced step.

Measures, side by side in one process, a training step (forward, backward, SGD step) of a small and
a mid-size CNN: untraced, under ``OpRecorder`` (names and attribution only), and under ``Tracer``
(every op's inputs and outputs digested). Steps alternate between the modes so that load on the
machine hits all of them alike; the median of each is reported with the ratio. Writing the trace
file (once per traced region, not per op) is timed apart and shown in its own column.

Run: ``python benchmarks/trace_overhead.py [--steps N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

from torchrepro.tracing import OpRecorder, Tracer


def small_cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.25),
        nn.Linear(16 * 7 * 7, 10),
    )
    return model, torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.skip(x))


def mid_cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A ResNet-style net (8 residual blocks, 32-256 channels, ~2.8 M parameters) on 32x32 images."""
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()]
    cin = 32
    for cout, stride in ((32, 1), (32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1)):
        layers.append(_Block(cin, cout, stride))
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(cin, 10)]
    return nn.Sequential(*layers), torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))


def _nothing() -> None:
    pass


def measure(
    name: str, build: Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]], steps: int, directory: str
) -> dict[str, object]:
    torch.manual_seed(0)
    model, x, y = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def plain() -> None:
        step()

    def recorded() -> None:
        with OpRecorder():
            step()

    path = os.path.join(directory, f"{name}.trace.json")
    tracer = Tracer(path)
    writes: list[float] = []

    def traced() -> None:
        step()

    def start_traced() -> None:
        tracer.start()

    def stop_traced() -> None:
        start = time.perf_counter()
        tracer.stop()
        writes.append(time.perf_counter() - start)

    modes = {"untraced": plain, "op recorder": recorded, "tracer": traced}
    setup = {"tracer": start_traced}
    teardown = {"tracer": stop_traced}
    for mode, run in modes.items():  # warm-up (first-use costs, allocator)
        setup.get(mode, _nothing)()
        run()
        teardown.get(mode, _nothing)()
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(steps):
        for mode, run in modes.items():
            setup.get(mode, _nothing)()
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            times[mode].append(time.perf_counter() - start)
            cpu[mode].append(time.process_time() - start_cpu)
            teardown.get(mode, _nothing)()
    median = {mode: statistics.median(ts) for mode, ts in times.items()}
    median_cpu = {mode: statistics.median(ts) for mode, ts in cpu.items()}
    return {
        "model": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "ops_per_step": len(json.load(open(path))["records"]),
        "write_ms": round(statistics.median(writes) * 1e3, 2),
        "trace_bytes": os.path.getsize(path),
        "untraced_ms": round(median["untraced"] * 1e3, 2),
        "recorder_ms": round(median["op recorder"] * 1e3, 2),
        "tracer_ms": round(median["tracer"] * 1e3, 2),
        "recorder_ratio": round(median["op recorder"] / median["untraced"], 2),
        "tracer_ratio": round(median["tracer"] / median["untraced"], 2),
        "tracer_cpu_ratio": round(median_cpu["tracer"] / median_cpu["untraced"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for name, build in (("small CNN", small_cnn), ("mid CNN", mid_cnn)):
            rows.append(measure(name, build, args.steps, directory))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.steps} steps each")
    header = f"{'model':10s} {'params':>9s} {'ops':>5s} {'untraced':>10s} {'recorder':>10s} {'tracer':>10s}"
    print(header + f" {'rec/plain':>9s} {'trace/plain':>11s} {'(cpu time)':>10s} {'file write':>10s}")
    for r in rows:
        print(
            f"{r['model']!s:10s} {r['parameters']!s:>9s} {r['ops_per_step']!s:>5s} "
            f"{r['untraced_ms']!s:>8s}ms {r['recorder_ms']!s:>8s}ms {r['tracer_ms']!s:>8s}ms "
            f"{r['recorder_ratio']!s:>8s}x {r['tracer_ratio']!s:>10s}x {r['tracer_cpu_ratio']!s:>9s}x "
            f"{r['write_ms']!s:>8s}ms"
        )
    print("target: tracer <= 2x untraced (wall clock; the CPU-time ratio is less sensitive to other load)")


if __name__ == "__main__":
    main()
