"""Claim (issue 33): on a 10M+ parameter model, an InvariantDataParallel step costs at most 1.3x a
DDP step with the same gradient accumulation at W = 2, 4 and 8 processes, and each rank sends
within 1.2x the bytes of a ring all-reduce.

Run: ``python benchmarks/invariant_scaling.py [--worlds 2,4,8] [--rounds 5] [--steps 2]``.

One torchrun launch per world size W (gloo on CPU, one thread per rank), a 12.6M-parameter MLP
(1024 -> 4096 -> 2048 -> 10), micro-batch 4, V = 8 micro-batches per global batch, so each rank
runs V/W micro-batches per step. Side by side in the same processes, interleaved round by round
(``invariant_step.timers``: DDP with ``no_sync`` on all but the last micro-batch, against
``SeededLoader(global_batch_size=...)`` + ``InvariantDataParallel``, the same micro-batches per
rank, optimizer step included). Reported per W: the median seconds per global batch of each and
their ratio, and the bytes a rank sends per step: InvariantDataParallel's two all-to-alls, exact
from the reduction's plan (``tree.sent_elements``, the busiest rank), against a ring all-reduce's
``2(W-1)/W n`` float32 (DDP's gloo all-reduce may move more; the ring is the bound to meet).

This machine has 2 cores: at W = 4 and 8 the ranks share them, so the step times there measure
CPU contention as much as either system (both sides alike: the rounds interleave); the byte
counts are exact whatever the load.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO, V = 4, 8
SIZES = (1024, 4096, 2048, 10)  # 12,609,546 parameters


def _step_benchmark():  # type: ignore[no-untyped-def]
    path = Path(__file__).with_name("invariant_step.py")
    spec = importlib.util.spec_from_file_location("invariant_step", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(steps: int):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [nn.Linear(a, b), nn.ReLU()]
    net = nn.Sequential(*layers[:-1])
    g = torch.Generator().manual_seed(1)
    n = V * MICRO * steps
    data = torch.utils.data.TensorDataset(
        torch.randn(n, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (n,), generator=g)
    )
    return net, data


def child(rounds: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from torchrepro.invariant.tree import sent_elements

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net_d, data = build(steps)  # one epoch: `steps` global batches
    net_i, _ = build(steps)
    run_ddp, run_inv, *_ = _step_benchmark().pair(net_d, net_i, data, steps, MICRO, V)
    run_ddp(), run_inv()  # warm-up
    ddp_times, inv_times = [], []
    for _ in range(rounds):
        ddp_times.append(run_ddp())
        inv_times.append(run_inv())
    if rank == 0:
        n = sum(p.numel() for p in net_i.parameters())
        ring = 2 * (world - 1) / world * n * 4
        sent = max(sent_elements(n, V, world, r) for r in range(world)) * 4
        d, i = statistics.median(ddp_times), statistics.median(inv_times)
        shared = "" if world <= 2 else f"  ({world} ranks share 2 cores)"
        print(
            f"W={world} ({V // world} micro-batches/rank)  DDP {d * 1e3:7.1f} ms/step  invariant "
            f"{i * 1e3:7.1f} ms/step  ratio {i / d:.2f}x   sent/rank: ring {ring / 1e6:6.1f} MB, "
            f"invariant {sent / 1e6:6.1f} MB  ratio {sent / ring:.2f}x{shared}",
            flush=True,
        )
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # plain torchrun: torch's gloo worker may abort a rank at exit (pytorch#190489); printed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="global batches per round")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.rounds, args.steps)
        return
    params = sum(a * b + b for a, b in itertools.pairwise(SIZES))
    print(
        f"InvariantDataParallel vs DDP (no_sync accumulation): MLP {params:,} parameters, micro-batch "
        f"{MICRO}, V={V}, gloo, 1 thread/rank, median of {args.rounds} rounds x {args.steps} steps "
        f"(targets: step <= 1.3x, bytes <= 1.2x); this machine has {os.cpu_count()} cores"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for w in (int(x) for x in args.worlds.split(",")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={w}"]
        cmd += [__file__, "--child", "--rounds", str(args.rounds), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"W={w} failed:\n{proc.stderr[-3000:]}")
        print(proc.stdout.rstrip(), flush=True)


if __name__ == "__main__":
    main()
