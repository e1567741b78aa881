"""Measured for issue 33 (no claim yet): what InvariantDataParallel's reduction
(``tree.reduce_pieces``: up the tree to rank 0, one point-to-point transfer after another, then a
broadcast; two ranks: one all-gather) costs against ``dist.all_reduce`` (what DDP does; its bits
depend on W), and what gloo's collectives cost on this machine, which decides how a
bandwidth-optimal replacement must be built.

Run: ``python benchmarks/invariant_reduce.py [--worlds 2,4,8] [--params 12600000] [--rounds 5]``.

One torchrun launch per world size W (gloo, one thread per rank), V = 8 micro-batches per global
batch, a flat float32 gradient of ``--params`` elements; side by side in the same processes,
interleaved round by round. Reported: the median milliseconds of all_reduce and of
``reduce_pieces`` (and their ratio), the bytes rank 0 receives one after another and sends in the
tree against a ring all-reduce's per rank, and the medians of gloo's all_to_all_single and
all_gather_into_tensor moving the same bytes. On this 2-core machine W > 2 ranks share two cores,
so the times there measure CPU contention as much as the pattern; the byte counts are exact.
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
V = 8


def _bytes(n: int, w: int) -> dict[str, float]:
    """Float32 bytes: a ring all-reduce sends 2(W-1)/W n per rank; in the tree rank 0 receives one
    value per tree level it owns the left child of, one after another, and broadcasts the root."""
    from torchrepro.invariant.tree import schedule

    ring = 2 * (w - 1) / w * n * 4
    received = sum(1 for _, lo, ro in schedule(V, w) if lo == 0 and ro != 0) * n * 4
    return {"ring": ring, "tree_recv_rank0": received if w > 2 else n * 4, "tree_send_rank0": (w - 1) * n * 4}


def child(params: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from torchrepro.invariant.tree import Accumulator, blocks, reduce_pieces

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, w = dist.get_rank(), dist.get_world_size()
    block = blocks(V, w)[rank]
    g = torch.Generator().manual_seed(rank)
    leaves = {j: torch.randn(params, generator=g) for j in range(*block)}
    flat = torch.randn(params, generator=g)
    out = torch.empty(params)

    def mine() -> dict:  # type: ignore[type-arg]
        acc = Accumulator(block, V)
        for j in range(*block):
            acc.push(j, leaves[j].clone())
        return acc.done()

    def timed(run) -> float:  # type: ignore[no-untyped-def]
        dist.barrier()
        start = time.perf_counter()
        run()
        dist.barrier()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {
        "all_reduce": [],
        "reduce_pieces": [],
        "all_to_all": [],
        "all_gather": [],
    }
    chunk = flat[: params // w].clone()
    for _ in range(rounds):
        summed, pieces_now, gathered = flat.clone(), mine(), out[: (params // w) * w]
        times["all_reduce"].append(timed(lambda s=summed: dist.all_reduce(s)))
        times["reduce_pieces"].append(timed(lambda p=pieces_now: reduce_pieces(p, V, w, rank)))
        times["all_to_all"].append(timed(lambda: dist.all_to_all_single(out, flat)))
        times["all_gather"].append(timed(lambda g=gathered: dist.all_gather_into_tensor(g, chunk)))
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        sent = _bytes(params, w)
        print(
            f"W={w}  all_reduce {med['all_reduce']:7.1f} ms   reduce_pieces {med['reduce_pieces']:7.1f} ms "
            f"({med['reduce_pieces'] / med['all_reduce']:.2f}x)   gloo moving the same data: "
            f"all_to_all_single {med['all_to_all']:.1f} ms, all_gather_into_tensor {med['all_gather']:.1f} ms"
        )
        print(
            f"      MB: a ring all-reduce sends {sent['ring'] / 1e6:.1f} per rank; the tree's rank 0 "
            f"receives {sent['tree_recv_rank0'] / 1e6:.1f} one after another and sends "
            f"{sent['tree_send_rank0'] / 1e6:.1f}"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--params", type=int, default=12_600_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.params, args.rounds)
        return
    print(f"InvariantDataParallel's reduction, {args.params:,} float32 gradients, V={V}, gloo, 1 thread/rank")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for w in (int(x) for x in args.worlds.split(",")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={w}"]
        cmd += [__file__, "--child", "--params", str(args.params), "--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"W={w} failed:\n{proc.stderr[-3000:]}")
        print(proc.stdout.rstrip())


if __name__ == "__main__":
    main()
