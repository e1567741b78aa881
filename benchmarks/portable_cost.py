"""Claim: what ``--portable`` costs a CPU training step (docs/guarantees.md, "What it costs").

Run: ``python benchmarks/portable_cost.py [--threads 1 2] [--rounds N] [--steps N] [--parts]``.

Portable mode is set when a process starts (``MKL_CBWR``, ``ATEN_CPU_CAPABILITY``) and in the child
(oneDNN off), so each variant runs in a process of its own, started with the environment
``torchrepro run`` gives it (``ChildSpec(..., portable=...).to_env()``; the worker applies what the
child's session applies). Both workers are started once and kept; the rounds are interleaved: in
each round every worker times ``--steps`` steps while the others wait, so they never share the
cores. Printed per workload and thread count: the best and median step time of each variant and
the ratio portable/default (> 1: portable is that much slower; on a shared machine trust the
best-of ratio more). ``--parts`` adds one worker per setting (oneDNN off, ``MKL_CBWR`` alone, the
ISA alone) to show where the cost comes from.

- ``cnn``: forward + backward + SGD step of a small CNN (conv, BatchNorm, ReLU, dropout, conv,
  pooling, linear; batch 32, 3x32x32), strict mode as ``torchrepro run`` sets it;
- ``transformer``: the same for a 2-layer ``nn.TransformerEncoder`` (d_model 128, 4 heads,
  feed-forward 256, batch 16 x 64 tokens) with a linear head and AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "src"))

WORKLOADS = ("cnn", "transformer")


# --- the worker: one process per variant ------------------------------------------------------------


def _cnn() -> Callable[[], None]:
    import torch
    from torch import nn

    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 16 * 16, 10),
    )
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _transformer() -> Callable[[], None]:
    import torch
    from torch import nn

    layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.1, batch_first=True)
    encoder, head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(128, 10)
    x, y = torch.randn(16, 64, 128), torch.randint(0, 10, (16,))
    opt = torch.optim.AdamW([*encoder.parameters(), *head.parameters()], lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(head(encoder(x).mean(1)), y).backward()
        opt.step()

    return step


def worker() -> None:
    """Build every workload, then answer ``<workload> <steps>`` lines with the steps' times (JSON)."""
    import torch

    from torchrepro.flags import set_determinism
    from torchrepro.portable import disable_onednn
    from torchrepro.protocol import ChildSpec

    spec = ChildSpec.from_env()
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if spec.portable or os.environ.get("BENCH_ONEDNN_OFF"):
        disable_onednn()
    torch.manual_seed(0)
    set_determinism("strict")
    steps = {"cnn": _cnn(), "transformer": _transformer()}
    for step in steps.values():  # warm up every path once
        for _ in range(3):
            step()
    print(json.dumps({"isa": str(torch.backends.cpu.get_cpu_capability())}), flush=True)
    for line in sys.stdin:
        name, count = line.split()
        times = []
        for _ in range(int(count)):
            start = time.perf_counter()
            steps[name]()
            times.append(time.perf_counter() - start)
        print(json.dumps(times), flush=True)


# --- the driver ---------------------------------------------------------------------------------


def _variants(parts: bool) -> dict[str, tuple[dict[str, object], dict[str, str]]]:
    """name -> (ChildSpec fields, extra environment). The first is the baseline."""
    from torchrepro.portable import CBWR_VAR, CPU_CAPABILITY_VAR, start_values

    out: dict[str, tuple[dict[str, object], dict[str, str]]] = {
        "default": ({}, {}),
        "portable": ({"portable": True}, {}),
    }
    if parts:
        values = start_values(os.environ)
        out["oneDNN off"] = ({}, {"BENCH_ONEDNN_OFF": "1"})
        out[CBWR_VAR] = ({}, {CBWR_VAR: values[CBWR_VAR]})
        if CPU_CAPABILITY_VAR in values:
            out[CPU_CAPABILITY_VAR] = ({}, {CPU_CAPABILITY_VAR: values[CPU_CAPABILITY_VAR]})
    return out


def _start(
    threads: int, fields: dict[str, object], extra: dict[str, str]
) -> tuple[subprocess.Popen[str], str]:
    from torchrepro.portable import CBWR_VAR, CPU_CAPABILITY_VAR
    from torchrepro.protocol import ChildSpec

    base = {k: v for k, v in os.environ.items() if k not in (CBWR_VAR, CPU_CAPABILITY_VAR)}
    env = ChildSpec(threads=threads, **fields).to_env(base)  # type: ignore[arg-type]
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (sys.path[0], env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    isa = json.loads(proc.stdout.readline())["isa"]
    return proc, isa


def _ask(proc: subprocess.Popen[str], name: str, steps: int) -> list[float]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{name} {steps}\n")
    proc.stdin.flush()
    return list(json.loads(proc.stdout.readline()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--steps", type=int, default=5, help="steps timed per round and variant (default 5)")
    parser.add_argument("--parts", action="store_true", help="also time each portable setting alone")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    import torch

    variants = _variants(args.parts)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPU(s), {args.rounds} interleaved rounds of "
        f"{args.steps} steps per variant; ratio = variant / default step time"
    )
    for threads in dict.fromkeys(args.threads):
        procs = {name: _start(threads, fields, extra) for name, (fields, extra) in variants.items()}
        try:
            isas = ", ".join(f"{name}: {isa}" for name, (_, isa) in procs.items())
            print(f"\n{threads} thread(s); kernels dispatched to {isas}")
            header = ("workload", "variant", "best (ms)", "ratio", "median (ms)", "ratio")
            print("{:<12} {:<20} {:>10} {:>6} {:>12} {:>6}".format(*header))
            for name in WORKLOADS:
                times: dict[str, list[float]] = {v: [] for v in procs}
                for _ in range(args.rounds):
                    for variant, (proc, _) in procs.items():
                        times[variant] += _ask(proc, name, args.steps)
                base_best, base_median = min(times["default"]), statistics.median(times["default"])
                for variant, values in times.items():
                    best, median = min(values), statistics.median(values)
                    print(
                        f"{name:<12} {variant:<20} {best * 1e3:10.2f} {best / base_best:5.2f}x "
                        f"{median * 1e3:12.2f} {median / base_median:5.2f}x"
                    )
        finally:
            for proc, _ in procs.values():
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait()


if __name__ == "__main__":
    main()
