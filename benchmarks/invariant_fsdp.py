"""Claim (issue 33, FSDP2): InvariantDataParallel over FSDP2 costs at most 1.3x a stock FSDP2 step
with the same gradient accumulation, holds at most 2x its gradient memory per rank, and ends with
the same parameters on every world size.

Run: ``python benchmarks/invariant_fsdp.py [--worlds 2,4] [--steps 10] [--warmup 2]``.

One torchrun launch per world size W (gloo on CPU, one thread per rank); a model of 4 pre-norm MLP
blocks (``x + Linear(4d, d)(GELU(Linear(d, 4d)(LayerNorm(x))))``) and a LayerNorm + Linear(d, 10)
head, d = 256 (2.1M parameters; A = 4 micro-batches' forward, backward and AdamW step take about
65 ms in one plain process here), ``fully_shard`` per block and at the root, AdamW, micro-batch 32,
V = 8 micro-batches per global batch (A = V/W per rank). Three copies of the model from the same
seed, each with its own ``SeededLoader(global_batch_size=...)`` (the same micro-batches per rank),
run side by side in the same processes, one global batch each in turn (the order rotating step by
step, so the machine's noise hits all alike):
- invariant: ``InvariantDataParallel(fsdp_model, loader)`` (an all-to-all per micro-batch, the
  canonical tree per shard);
- stock, sync last: FSDP2 with ``set_requires_gradient_sync(False)`` on all but the last
  micro-batch and the loss divided by A (one reduce-scatter per global batch);
- stock, sync every: FSDP2 reduce-scattering every micro-batch, the loss divided by A.
Reported per W: the median milliseconds per global batch (A forwards and backwards and the
optimizer step, between barriers) of each and the invariant side's ratios; the peak gradient
memory per rank of each (see ``Held``), the busiest rank's; ``model.peak_buffers``. Then the
fingerprint of the invariant runs' full parameters (``full_tensor()``) after all steps, which must
match across W, and, as the control, stock (sync last)'s, which need not.

This machine has 2 cores: at W = 4 the ranks share them, so the step times there measure CPU
contention as much as either method (all three alike); the memory figures are exact whatever the
load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
D, BLOCKS, CLASSES, MICRO, V = 256, 4, 10, 32, 8
METHODS = ("invariant", "sync last", "sync every")
KINDS = ("partial sums", "unsharded .grad", "sharded .grad")


def build(samples: int):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(D)
            self.up = nn.Linear(D, 4 * D)
            self.down = nn.Linear(4 * D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    net = nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.LayerNorm(D), nn.Linear(D, CLASSES))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, D, generator=g), torch.randint(0, CLASSES, (samples,), generator=g)
    )
    return net, data


def shard(net):  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp import fully_shard

    for block in net[:BLOCKS]:
        fully_shard(block)
    return fully_shard(net)


class Held:
    """The bytes a rank holds in gradient buffers, the most seen while ``on``: the distinct storages
    of the unsharded parameters' ``.grad`` and ``unsharded_accumulated_grad`` (what stock FSDP2
    accumulates into with gradient sync off), the sharded ``.grad`` (local shards) and, for the
    invariant wrapper, every partial sum in its accumulators (``_sharded.slots[i].accs[s]._stack``:
    views of the all-to-all buffers, counted as the whole buffers they keep alive). Taken when each
    FSDP2 group's backward is done (its unsharded gradients computed, before its reduction), when
    each all-to-all output arrives (before it is summed: counted too) and after each micro-batch.
    Not counted, on any side: autograd's new gradient before it is added to ``.grad``, FSDP2's flat
    reduce-scatter input and output (one group's size, for as long as one reduction),
    activations, the optimizer state."""

    def __init__(self, net, sharded) -> None:  # type: ignore[no-untyped-def]
        from torchrepro.invariant.fsdp import fsdp_modules

        self.net, self.sharded, self.on, self.peak = net, sharded, False, 0
        self.parts = dict.fromkeys(KINDS, 0)  # the peak's bytes by kind
        self.groups = [m._get_fsdp_state()._fsdp_param_group for m in fsdp_modules(net)]
        self.fsdp_params = [fp for group in self.groups for fp in group.fsdp_params]
        for group in self.groups:
            group.post_backward = self._before(group.post_backward)
        if sharded is not None:  # push(slot, received, reduce_output): count what arrived
            sharded.push = self._before(sharded.push, arrived=1)

    def _before(self, fn, arrived: int | None = None):  # type: ignore[no-untyped-def]
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.record(*([] if arrived is None else [args[arrived]]))
            return fn(*args, **kwargs)

        return wrapped

    def record(self, *extra: Any) -> None:
        if not self.on:
            return
        partial = list(extra)
        for slot in self.sharded.slots if self.sharded is not None else []:
            partial += [t for acc in slot.accs for _, t in acc._stack]
        unsharded = []
        for fp in self.fsdp_params:
            param = getattr(fp, "_unsharded_param", None)
            unsharded += [
                t for t in (getattr(param, "grad", None), fp.unsharded_accumulated_grad) if t is not None
            ]
        grads = (fp.sharded_param.grad for fp in self.fsdp_params)  # not net.parameters(): in a
        sharded = [g.to_local() for g in grads if g is not None]  # backward, those are unsharded
        seen: set[int] = set()
        sizes = dict.fromkeys(KINDS, 0)
        for kind, tensors in zip(KINDS, (partial, unsharded, sharded), strict=True):
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    sizes[kind] += storage.nbytes()
        if sum(sizes.values()) > self.peak:
            self.peak, self.parts = sum(sizes.values()), sizes

    def close(self) -> None:
        """Unwrap: the timed steps run FSDP2's and the wrapper's own methods."""
        for group in self.groups:
            del group.post_backward
        if self.sharded is not None:
            del self.sharded.push


def method(name: str, samples: int):  # type: ignore[no-untyped-def]
    """One global batch of ``name`` at a time: ``(step, net, held, model)``."""
    import torch
    from torch import nn

    import torchrepro

    net, data = build(samples)
    shard(net)
    loader = torchrepro.SeededLoader(data, batch_size=MICRO, global_batch_size=V * MICRO, seed=0)
    model = torchrepro.InvariantDataParallel(net, loader) if name == "invariant" else net
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held = Held(net, getattr(model, "_sharded", None))
    a = loader.accumulation_steps
    loader.set_epoch(0)
    it = iter(loader)

    def step() -> None:
        for k in range(a):
            x, y = next(it)
            loss = nn.functional.cross_entropy(model(x), y)
            if name != "invariant":
                net.set_requires_gradient_sync(name == "sync every" or k == a - 1)
                loss = loss / a
            loss.backward()
            held.record()
        opt.step()
        opt.zero_grad()

    return step, net, held, model


def child(steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist

    import torchrepro

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = (steps + warmup) * V * MICRO  # one epoch: every step a fresh global batch
    runs = {name: method(name, samples) for name in METHODS}
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for i in range(warmup + steps):
        for name in METHODS[i % 3 :] + METHODS[: i % 3]:
            step, _, held, _ = runs[name]
            held.on = i < warmup  # memory on the warm-up steps, untimed
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
        if i == warmup - 1:
            for _, _, held, _ in runs.values():
                held.close()
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, {name: (runs[name][2].peak, runs[name][2].parts) for name in METHODS})
    fingerprinted = ("invariant", "sync last")
    full = {
        name: {n: p.detach().full_tensor() for n, p in runs[name][1].named_parameters()}
        for name in fingerprinted
    }
    if rank == 0:
        result = {
            "world": world,
            "a": V // world,
            "ms": {name: statistics.median(times[name]) * 1e3 for name in METHODS},
            "held": {name: max((p[name] for p in peaks), key=lambda x: x[0]) for name in METHODS},
            "peak_buffers": runs["invariant"][3].peak_buffers,
            "fingerprint": {name: torchrepro.fingerprint(full[name]) for name in fingerprinted},
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=10, help="timed global batches per method")
    parser.add_argument("--warmup", type=int, default=2, help="untimed global batches (memory measured)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.steps, args.warmup)
        return
    params = BLOCKS * (2 * D + 8 * D * D + 5 * D) + 2 * D + D * CLASSES + CLASSES
    print(
        f"InvariantDataParallel over FSDP2 vs stock FSDP2: {BLOCKS} MLP blocks d={D}, {params:,} parameters "
        f"(float32 gradients {params * 4 / 1e6:.1f} MB), micro-batch {MICRO}, V={V}, AdamW, gloo, "
        f"1 thread/rank, median of {args.steps} steps after {args.warmup} (targets: step <= 1.3x, "
        "gradient memory <= 2x); "
        f"this machine has {os.cpu_count()} cores"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    results = []
    for w in (int(x) for x in args.worlds.split(",")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={w}"]
        cmd += [__file__, "--child", "--steps", str(args.steps), "--warmup", str(args.warmup)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"W={w} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        results.append(json.loads(lines[0].removeprefix("RESULT ")))
    print(
        f"{'':8} {'ms per global batch':^38} | {'invariant / stock':^17} | "
        f"{'peak gradient MB per rank':^38} | {'invariant / stock':^17}"
    )
    print(
        f"{'W (A)':8}"
        + (f" {'invariant':>12} {'sync last':>12} {'sync every':>12} | {'last':>8} {'every':>8} |" * 2)
    )
    for r in results:
        ms = r["ms"]
        held = {m: r["held"][m][0] / 1e6 for m in METHODS}
        cells = [f"W={r['world']} ({r['a']})".ljust(8)]
        for values in (ms, held):
            cells.append(" ".join(f"{values[m]:12.1f}" for m in METHODS))
            i = values["invariant"]
            cells.append(f"| {i / values['sync last']:7.2f}x {i / values['sync every']:7.2f}x |")
        print(" ".join(cells) + f" peak_buffers {r['peak_buffers']}")
    print("peak gradient MB per rank by kind (partial sums / unsharded .grad / sharded .grad):")
    for r in results:
        parts = (f"{m} " + " / ".join(f"{r['held'][m][1][k] / 1e6:.1f}" for k in KINDS) for m in METHODS)
        print(f"  W={r['world']}: " + ", ".join(parts))
    for name, label in (("invariant", "invariant"), ("sync last", "stock FSDP2 (sync last), control")):
        prints = {r["world"]: r["fingerprint"][name] for r in results}
        same = "identical" if len(set(prints.values())) == 1 else "differ"
        print(
            f"final parameters, {label}: "
            + ", ".join(f"W={w} {fp}" for w, fp in prints.items())
            + f" -> {same}"
        )


if __name__ == "__main__":
    main()
