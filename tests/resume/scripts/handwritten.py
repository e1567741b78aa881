"""A plain PyTorch training script with hand-written checkpoints, resumable after a SIGKILL.

    python handwritten.py [--bug {none,rng,optimizer,nosave}] [--epochs 2] [--ckpt ckpt.pt]

A tiny MLP with dropout (draws from the global torch RNG) trains with Adam (state that matters)
on 48 generated samples, batch 8: 6 optimizer steps per epoch. Each epoch's order is a
permutation keyed by the epoch alone, so a resume can continue mid-epoch. After every step it
writes ``ckpt.pt`` in the working directory (atomically: a temporary name, then ``os.replace``);
on start it continues from ``ckpt.pt`` when there is one. It prints ``START_STEP <n>`` (optimizer
steps already done) first and saves the final ``state_dict`` to ``final.pt``.

``--bug`` plants a resume bug: ``rng`` neither saves nor restores the RNG state (dropout masks
differ after a resume), ``optimizer`` does not restore the optimizer state (Adam starts over),
``nosave`` never writes a checkpoint (a restart trains from step 0). ``none`` resumes exactly: it
restores the RNG state last, after everything that could draw from it was built.

Test hook: ``RESUME_CRASH_AFTER=K`` SIGKILLs the process right after the checkpoint save of the
K-th optimizer step (counted from 1 across epochs; with ``--bug nosave`` there is no save).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
from torch import nn

N_SAMPLES = 48
BATCH_SIZE = 8
STEPS_PER_EPOCH = N_SAMPLES // BATCH_SIZE  # 6
CKPT = "ckpt.pt"
FINAL = "final.pt"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", choices=("none", "rng", "optimizer", "nosave"), default="none")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt", default=CKPT, help="where the checkpoint goes (default: ckpt.pt here)")
    args = parser.parse_args()
    crash_after = int(os.environ.get("RESUME_CRASH_AFTER", "0"))

    torch.manual_seed(0)
    torch.set_num_threads(1)  # CPU results may depend on the thread count; fix it
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(123)
    inputs = torch.randn(N_SAMPLES, 8, generator=g)
    labels = torch.randint(0, 4, (N_SAMPLES,), generator=g)
    criterion = nn.CrossEntropyLoss()

    step = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        if args.bug != "optimizer":
            optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        if args.bug != "rng":
            torch.set_rng_state(state["rng"])  # last: nothing above may draw from the stream
    print(f"START_STEP {step}", flush=True)

    model.train()
    for epoch in range(step // STEPS_PER_EPOCH, args.epochs):
        order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(1000 + epoch))
        for position in range(step - epoch * STEPS_PER_EPOCH, STEPS_PER_EPOCH):
            batch = order[position * BATCH_SIZE : (position + 1) * BATCH_SIZE]
            optimizer.zero_grad(set_to_none=True)
            criterion(model(inputs[batch]), labels[batch]).backward()
            optimizer.step()
            step += 1
            if args.bug != "nosave":
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                    "position": position + 1,  # optimizer steps done in this epoch
                    "step": step,
                }
                if args.bug != "rng":
                    state["rng"] = torch.get_rng_state()
                torch.save(state, args.ckpt + ".tmp")
                os.replace(args.ckpt + ".tmp", args.ckpt)
            if step == crash_after:
                os.kill(os.getpid(), signal.SIGKILL)

    torch.save(model.state_dict(), FINAL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
