"""One small MLP's gradients clipped by ``torchrepro.clip_grad_norm_`` and by torch's own, in
float32 and in float64.

python clip_fsdp.py OUT.json

As a plain process: the whole model, no process group (DDP's view: every gradient whole on every
rank). Under torchrun (``torchrepro run --mode off --nproc N``: gloo, 1 thread per rank): FSDP2,
``fully_shard`` per Linear and at the root, so every gradient is a DTensor sharded along dim 0,
unevenly (24 and 5 rows on 2 and 4 ranks: on 4 ranks the last Linear's rows are 2, 2, 1, 0).
Every rank computes the same gradients (the same seeded input, a sum loss), so FSDP2's averaged
gradients are the plain ones, bit for bit (``before``). Torch clips first, the gradients are put
back, then torchrepro clips. Rank 0 writes OUT, per dtype: each rank's total norm
(``float.hex``), torch's, the fingerprint of the full gradients before and after torchrepro's
clipping, and each rank's shard shapes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import torchrepro

torch.set_num_threads(1)
MAX_NORM = 1.0


def hexed(total: torch.Tensor) -> str:
    if hasattr(total, "full_tensor"):  # torch's total of DTensor gradients is a DTensor
        total = total.full_tensor()
    return float(total).hex()


def full(grads: list[Any]) -> str:
    return torchrepro.fingerprint([g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads])


def clip_both(dtype: torch.dtype, sharded: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(13, 24), nn.LayerNorm(24), nn.Tanh(), nn.Linear(24, 5)).to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 13, generator=g) * torch.logspace(-3, 3, 13)  # inputs of mixed magnitudes
    if sharded:
        from torch.distributed.fsdp import fully_shard

        fully_shard(net[0])
        fully_shard(net[3])
        fully_shard(net)
    (net(x.to(dtype)) ** 2).sum().backward()

    params = list(net.parameters())
    grads = [p.grad for p in params]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    saved = [t.clone() for t in local]
    before = full(grads)
    theirs = hexed(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
    for t, s in zip(local, saved, strict=True):
        t.copy_(s)
    total = torchrepro.clip_grad_norm_(params, MAX_NORM)
    assert type(total) is torch.Tensor and total.dim() == 0, type(total)
    assert float(total) > MAX_NORM  # the gradients are scaled, not left alone
    mine = (hexed(total), theirs, [list(t.shape) for t in local])
    every: list[Any] = [mine]
    if sharded:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    return {
        "ours": [e[0] for e in every],
        "torch": [e[1] for e in every],
        "shards": [e[2] for e in every],
        "before": before,
        "after": full(grads),
    }


def main() -> None:
    sharded = "RANK" in os.environ
    if sharded:
        dist.init_process_group("gloo")
    result = {str(dtype): clip_both(dtype, sharded) for dtype in (torch.float32, torch.float64)}
    if not sharded or dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(result))
    if sharded:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
