"""The training of ``handwritten.py`` with torchrepro's own checkpoints and loader.

    python own_checkpoints.py [--epochs 2]

A tiny MLP with dropout trains with Adam on 48 generated samples through a
``torchrepro.SeededLoader`` (batch 8, 6 steps per epoch, no workers). After every optimizer
step ``torchrepro.save_checkpoint`` writes ``ckpts/step-NNNNN.pt`` in the working directory
(model, optimizer, loader position, RNG state) and the two newest are kept; on start it resumes
from ``torchrepro.latest_checkpoint("ckpts")`` when there is one. It prints ``START_STEP <n>``
(optimizer steps already done) first and saves the final ``state_dict`` to ``final.pt``.

Test hook: ``RESUME_CRASH_AFTER=K`` SIGKILLs the process right after the checkpoint save of the
K-th optimizer step (counted from 1 across epochs).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
from torch import nn

import torchrepro

SEED = 0
N_SAMPLES = 48
BATCH_SIZE = 8
STEPS_PER_EPOCH = N_SAMPLES // BATCH_SIZE  # 6
CKPT_DIR = "ckpts"
FINAL = "final.pt"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    crash_after = int(os.environ.get("RESUME_CRASH_AFTER", "0"))
    total = args.epochs * STEPS_PER_EPOCH

    torchrepro.seed_everything(SEED)
    torch.set_num_threads(1)  # CPU results may depend on the thread count; fix it
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(123)
    data = torch.utils.data.TensorDataset(
        torch.randn(N_SAMPLES, 8, generator=g), torch.randint(0, 4, (N_SAMPLES,), generator=g)
    )
    loader = torchrepro.SeededLoader(data, batch_size=BATCH_SIZE, seed=SEED, num_workers=0)
    criterion = nn.CrossEntropyLoss()

    step = 0
    latest = torchrepro.latest_checkpoint(CKPT_DIR)
    if latest is not None:
        step = torchrepro.load_checkpoint(latest, model=model, optimizer=optimizer, loader=loader)["step"]
    print(f"START_STEP {step}", flush=True)

    model.train()
    while step < total:
        for inputs, labels in loader:  # continues the saved epoch mid-way after a resume
            optimizer.zero_grad(set_to_none=True)
            criterion(model(inputs), labels).backward()
            optimizer.step()
            step += 1
            optimizer.zero_grad(set_to_none=True)  # keeps the gradients out of the checkpoint
            torchrepro.save_checkpoint(
                f"{CKPT_DIR}/step-{step:05d}.pt", model=model, optimizer=optimizer, loader=loader, step=step
            )
            torchrepro.prune_checkpoints(CKPT_DIR, keep=2)
            if step == crash_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= total:
                break

    torch.save(model.state_dict(), FINAL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
