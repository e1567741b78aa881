"""Claim: an InvariantDataParallel step costs at most 1.3x a DDP step with the same gradient
accumulation (2 processes, gloo, CPU), and holds at most about log2(V) extra gradient buffers.

Run: ``python benchmarks/invariant_step.py [--world 2] [--rounds 5] [--steps 6] [--model cnn|mlp|both]``.

Side by side in one torchrun launch, interleaved round by round in the same processes (same
threads, 1 per rank), on the same data and model:
- DDP: ``DistributedDataParallel`` with ``no_sync()`` on all but the last micro-batch of a global
  batch, the loss divided by the accumulation steps (the stock way to accumulate);
- invariant: ``SeededLoader(global_batch_size=...)`` + ``InvariantDataParallel`` (keyed forwards,
  each micro-batch's gradient taken out, the tree over the global micro-batch index).
Both iterate a ``SeededLoader`` (DDP with ``batch_size`` = micro-batch, its own shard) so the
loader's cost is the same on both sides. Reported: median seconds per global batch (optimizer
step included), the ratio, and the invariant side's extra gradient memory: the most flat
gradient buffers a rank held at once (partial sums of the tree) against the model's gradients.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO, V = 16, 8


def build(kind: str, steps: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "cnn":
        net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 8 * 8, 10),
        )  # fmt: skip
        data = torch.utils.data.TensorDataset(
            torch.randn(V * MICRO * steps, 3, 32, 32), torch.randint(0, 10, (V * MICRO * steps,))
        )
    else:
        net = nn.Sequential(
            nn.Linear(256, 1024),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(1024, 1024),
            nn.ReLU(),
            nn.Linear(1024, 10),
        )
        data = torch.utils.data.TensorDataset(
            torch.randn(V * MICRO * steps, 256), torch.randint(0, 10, (V * MICRO * steps,))
        )
    return net, data


def timers(steps, ddp, opt_d, plain_loader, inv, opt_i, inv_loader):  # type: ignore[no-untyped-def]
    """Two closures timing ``steps`` global batches (optimizer step included) of DDP with
    ``no_sync`` accumulation and of InvariantDataParallel over the same micro-batches per rank:
    seconds per global batch, between barriers. Shared with ``invariant_scaling.py``."""
    import torch.distributed as dist
    from torch import nn

    accumulation = inv_loader.accumulation_steps

    def run_ddp() -> float:
        it = iter(plain_loader)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            for k in range(accumulation):
                x, y = next(it)
                if k < accumulation - 1:
                    with ddp.no_sync():
                        (nn.functional.cross_entropy(ddp(x), y) / accumulation).backward()
                else:
                    (nn.functional.cross_entropy(ddp(x), y) / accumulation).backward()
            opt_d.step()
            opt_d.zero_grad()
        dist.barrier()
        return (time.perf_counter() - start) / steps

    def run_inv() -> float:
        it = iter(inv_loader)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            for _k in range(accumulation):
                x, y = next(it)
                nn.functional.cross_entropy(inv(x), y).backward()
            opt_i.step()
            opt_i.zero_grad()
        dist.barrier()
        return (time.perf_counter() - start) / steps

    return run_ddp, run_inv


def pair(net_d, net_i, data, steps, micro=MICRO, v=V):  # type: ignore[no-untyped-def]
    """DDP around ``net_d`` and InvariantDataParallel around ``net_i`` (the same weights), each with
    its loader over ``data`` and momentum SGD, and their ``timers``: ``(run_ddp, run_inv, inv,
    inv_loader)``. Shared with ``invariant_scaling.py``."""
    import torch
    from torch import nn

    import torchrepro

    ddp = nn.parallel.DistributedDataParallel(net_d)
    plain_loader = torchrepro.SeededLoader(data, batch_size=micro, seed=0, drop_last=True)
    inv_loader = torchrepro.SeededLoader(data, batch_size=micro, global_batch_size=v * micro, seed=0)
    inv = torchrepro.InvariantDataParallel(net_i, inv_loader)
    opt_d = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    opt_i = torch.optim.SGD(inv.parameters(), lr=0.01, momentum=0.9)
    return (*timers(steps, ddp, opt_d, plain_loader, inv, opt_i, inv_loader), inv, inv_loader)


def child(kind: str, rounds: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net_d, data = build(kind, steps)  # one epoch: `steps` global batches
    net_i, _ = build(kind, steps)
    run_ddp, run_inv, inv, inv_loader = pair(net_d, net_i, data, steps)

    run_ddp(), run_inv()  # warm-up
    accumulation = inv_loader.accumulation_steps
    ddp_times, inv_times = [], []
    for _ in range(rounds):
        ddp_times.append(run_ddp())
        inv_times.append(run_inv())
    if rank == 0:
        params = sum(p.numel() * p.element_size() for p in net_i.parameters())
        d, i = statistics.median(ddp_times), statistics.median(inv_times)
        shape = f"{kind:4} W={world} V={V} micro={MICRO} accumulation={accumulation}"
        print(
            f"{shape}: DDP {d * 1e3:8.2f} ms/step, invariant {i * 1e3:8.2f} ms/step, ratio {i / d:.2f}x "
            f"(target <= 1.3x); extra gradient buffers held at once: {inv.peak_buffers} x "
            f"{params / 2**20:.2f} MiB (log2(V) = {V.bit_length() - 1})"
        )
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # plain torchrun: torch's gloo worker may abort a rank at exit (pytorch#190489); printed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", choices=["cnn", "mlp", "both"], default="both")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rounds, args.steps)
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    for kind in ["cnn", "mlp"] if args.model == "both" else [args.model]:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.world),
        ]
        cmd += [__file__, "--child", kind, "--rounds", str(args.rounds), "--steps", str(args.steps)]
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
