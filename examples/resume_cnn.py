"""Train a small CNN that can be killed at any moment and resumed bit for bit.

    python examples/resume_cnn.py CKPT_DIR [--steps 60] [--save-every 5] [--stop-at N] [--out FILE]

A CNN with dropout learns 4 classes of tiny generated images; a ``torchrepro.SeededLoader`` with
two worker processes applies random augmentation (per-sample RNG), SGD with momentum and a
StepLR schedule train it. Every ``--save-every`` steps it writes ``CKPT_DIR/step-NNNNN.pt``; on
start it resumes from ``torchrepro.latest_checkpoint(CKPT_DIR)`` when there is one. At the end it
prints (and with ``--out`` writes as JSON) the fingerprint of the final parameters, which is the
same whether or not the run was interrupted.

``--stop-at N`` saves a checkpoint after step N and exits (a clean interruption).
``--no-restore-rng-loader`` resumes only model, optimizer and scheduler, like a naive resume
(the negative control: its final fingerprint differs).
Test hook: ``RESUME_CNN_SLOW_WRITE=<seconds>`` sleeps that long after each write call of a
checkpoint save (torch.save makes ~100 per file) and prints ``writing`` when the bytes start to
flow, so a test can kill the process while a checkpoint is half written.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch import nn

import torchrepro
from torchrepro import _io

SEED = 1234
N_SAMPLES = 96
BATCH_SIZE = 8
STEPS_PER_EPOCH = N_SAMPLES // BATCH_SIZE  # 12


class TinyImages(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """4 classes of 12x12 blobs; random flips, shifts and noise drawn from ``sample_rng()``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(SEED)
        self.labels = torch.randint(0, 4, (N_SAMPLES,), generator=g)
        yy, xx = torch.meshgrid(torch.arange(12.0), torch.arange(12.0), indexing="ij")
        centres = torch.tensor([[3.0, 3.0], [3.0, 8.0], [8.0, 3.0], [8.0, 8.0]])[self.labels]
        d2 = (yy - centres[:, 0, None, None]) ** 2 + (xx - centres[:, 1, None, None]) ** 2
        self.images = torch.exp(-d2 / 6.0).unsqueeze(1) + 0.1 * torch.randn(N_SAMPLES, 1, 12, 12, generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = torchrepro.sample_rng()  # keyed by (seed, epoch, index): same for any worker
        image = self.images[index]
        if rng.random() < 0.5:
            image = image.flip(-1)
        image = image.roll(int(rng.integers(-1, 2)), dims=-2)
        noise = torch.from_numpy(rng.standard_normal(image.shape).astype(np.float32))
        return image + 0.05 * noise, int(self.labels[index])


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 6, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(6 * 5 * 5, 4),
    )


def slow_writes(seconds: float) -> None:
    """Test hook: sleep ``seconds`` after every write call of a checkpoint save."""
    original = _io.atomic_open

    class SlowFile:
        def __init__(self, f: IO[Any]) -> None:
            self.f, self.started = f, False

        def write(self, data: Any) -> int:
            if not self.started:
                self.started = True
                print("writing", flush=True)
            n = self.f.write(data)
            self.f.flush()
            time.sleep(seconds)
            return n

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

    @contextlib.contextmanager
    def slow_open(path: Any, mode: str = "wb", **options: Any) -> Iterator[Any]:
        with original(path, mode, **options) as f:
            yield SlowFile(f)

    _io.atomic_open = slow_open  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("ckpt_dir", type=Path)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-restore-rng-loader", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("RESUME_CNN_SLOW_WRITE"):
        slow_writes(float(os.environ["RESUME_CNN_SLOW_WRITE"]))

    torch.set_num_threads(1)  # CPU results depend on the thread count; fix it
    torchrepro.seed_everything(SEED)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    loader = torchrepro.SeededLoader(TinyImages(), batch_size=BATCH_SIZE, seed=SEED, num_workers=2)

    step = 0
    latest = torchrepro.latest_checkpoint(args.ckpt_dir) if args.ckpt_dir.is_dir() else None
    if latest is not None:
        if args.no_restore_rng_loader:  # the naive resume: what most training scripts do
            values = torchrepro.load_checkpoint(
                latest, model=model, optimizer=optimizer, scheduler=scheduler, restore_rng=False
            )
        else:
            values = torchrepro.load_checkpoint(
                latest, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader
            )
        step = values["step"]
        print(f"resumed from {Path(latest).name} at step {step}", flush=True)
        if args.no_restore_rng_loader:
            loader.set_epoch(step // STEPS_PER_EPOCH)

    print(f"training from step {step}", flush=True)
    criterion = nn.CrossEntropyLoss()
    model.train()
    while step < args.steps:
        for images, labels in loader:  # continues the saved epoch mid-way after a resume
            optimizer.zero_grad(set_to_none=True)
            criterion(model(images), labels).backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % args.save_every == 0 or step == args.stop_at:
                torchrepro.save_checkpoint(
                    args.ckpt_dir / f"step-{step:05d}.pt",
                    model=model,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    loader=loader,
                    step=step,
                )
            if step == args.stop_at:
                print(f"stopped at step {step}", flush=True)
                return 0
            if step >= args.steps:
                break

    digest = torchrepro.fingerprint(model)
    print(f"fingerprint {digest}", flush=True)
    if args.out is not None:
        _io.atomic_write_json(args.out, {"fingerprint": digest, "steps": step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
