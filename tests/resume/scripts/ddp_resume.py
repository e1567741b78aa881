"""Plain DDP (gloo, CPU) with hand-written checkpoints, resumable after every rank is SIGKILLed.

    torchrun --nproc_per_node 2 ddp_resume.py [--bug {none,rank-rng}]

Each rank trains a tiny MLP with dropout (each rank's own draws from the global torch RNG)
wrapped in ``DistributedDataParallel``, SGD with momentum (state that matters), on its half of a
keyed per-epoch permutation of 48 samples: 4 samples a rank, 6 optimizer steps an epoch, 2
epochs. After every step rank 0 writes ``ckpt.pt`` (model and optimizer) and every rank its RNG
state to ``rng.rank<R>.pt`` (each atomically), then all ranks meet at a barrier; on start every
rank continues from them when they exist. Rank 0 prints ``START_STEP <n>`` and writes the final
``state_dict`` to ``final.pt``.

``--bug rank-rng`` restores rank 0's RNG state on every rank (a common slip: one RNG file for
all ranks), so rank 1's dropout masks differ after a resume. ``none`` resumes exactly.

Test hook: ``RESUME_CRASH_AFTER=K`` makes every rank SIGKILL itself after the barrier of step K.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

N_SAMPLES = 48
PER_RANK = 4
STEPS_PER_EPOCH = N_SAMPLES // (2 * PER_RANK)  # 6


def _save(obj: object, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", choices=("none", "rank-rng"), default="none")
    args = parser.parse_args()
    crash_after = int(os.environ.get("RESUME_CRASH_AFTER", "0"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(123)
    inputs = torch.randn(N_SAMPLES, 8, generator=g)
    labels = torch.randint(0, 4, (N_SAMPLES,), generator=g)
    torch.manual_seed(1 + rank)  # each rank its own dropout stream
    step = 0
    if os.path.exists("ckpt.pt"):
        state = torch.load("ckpt.pt", weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        source = 0 if args.bug == "rank-rng" else rank
        torch.set_rng_state(torch.load(f"rng.rank{source}.pt", weights_only=True))
    if rank == 0:
        print(f"START_STEP {step}", flush=True)
    for epoch in range(step // STEPS_PER_EPOCH, 2):
        order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(1000 + epoch))
        for position in range(step - epoch * STEPS_PER_EPOCH, STEPS_PER_EPOCH):
            start = (position * world + rank) * PER_RANK
            batch = order[start : start + PER_RANK]
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(inputs[batch]), labels[batch]).backward()
            optimizer.step()
            step += 1
            if rank == 0:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                }
                _save(state, "ckpt.pt")
            _save(torch.get_rng_state(), f"rng.rank{rank}.pt")
            dist.barrier()
            if step == crash_after:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        torch.save(model.module.state_dict(), "final.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
