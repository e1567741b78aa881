"""A tiny Lightning fit (dropout, a dataset drawing noise per sample) that can kill itself and resume.

Usage: python train.py OUT [--variant torchrepro|stock] [--stream] [--devices N] [--workers N]
       [--epochs N] [--every N] [--limit N] [--partitions P] [--kill-at STEP] [--resume CKPT]

- ``torchrepro``: ``TorchreproCallback`` and a ``SeededLoader``; ``stock``: no callback, a plain
  ``DataLoader(shuffle=True)`` and ``lightning.seed_everything`` (what Lightning users do).
- ``--stream``: the training data is a ``torchrepro.ShardedDataset`` of 8 shards (36 samples,
  one shard empty), read with the same noise per sample; ``torchrepro`` streams it through
  ``SeededLoader(..., shuffle_buffer=8)``, ``stock`` through a plain ``DataLoader`` (each worker
  reads every ``num_workers``-th shard). Every shard opened is noted in ``OUT/reads.<pid>.txt``
  as ``shard start seed`` (``seed``: torch's initial seed when the shard opens, which the
  streamed loader sets from (seed, epoch, shard, start)). ``--limit N``: ``limit_train_batches=N``.
  ``--partitions P`` (with ``--stream``): global batches of 8 from ``P`` partitions, each rank
  reading only its own (``SeededLoader(..., global_batch_size=8, partitions=P)``).
- Checkpoints every ``--every`` optimizer steps to ``OUT/ckpt`` (``last.ckpt`` is the newest);
  with ``--kill-at K`` every rank SIGKILLs itself when batch K is about to start.
- Rank 0 writes the final parameters to ``OUT/final.pt``, every rank the determinism mode in
  effect to ``OUT/mode.rank<R>.txt``. With ``--devices 2`` Lightning starts rank 1 by running this
  file again, unless the ranks were started externally (``LOCAL_RANK`` set).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import torchrepro
from torchrepro.integrations.lightning import TorchreproCallback

SEED = 0


class NoisyPoints(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed points plus noise drawn from the global torch RNG on every load (augmentation)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


SHARD_LENGTHS = [7, 3, 0, 9, 5, 6, 4, 2]  # 36 samples
READS: Path | None = None  # where read_shard notes the shards it opens


def read_shard(shard: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shard ``shard`` from offset ``start``: fixed points plus noise from the global torch RNG."""
    if READS is not None:
        with open(READS / f"reads.{os.getpid()}.txt", "a") as f:
            f.write(f"{shard} {start} {torch.initial_seed()}\n")
    g = torch.Generator().manual_seed(1000 + shard)
    x = torch.randn(SHARD_LENGTHS[shard], 8, generator=g)
    y = torch.randn(SHARD_LENGTHS[shard], 1, generator=g)
    for i in range(start, SHARD_LENGTHS[shard]):
        yield x[i] + 0.1 * torch.randn(8), y[i]


def shards() -> IterableDataset[tuple[torch.Tensor, torch.Tensor]]:
    return torchrepro.ShardedDataset(range(len(SHARD_LENGTHS)), read_shard)


class Net(pl.LightningModule):
    def __init__(
        self, variant: str, workers: int, stream: bool = False, partitions: int | None = None
    ) -> None:
        super().__init__()
        self.variant, self.workers, self.stream, self.partitions = variant, workers, stream, partitions
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        torch.rand(self.global_rank + 1)  # ranks' streams differ: restoring another rank's state shows
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        if self.stream:
            if self.variant == "stock":
                return DataLoader(shards(), batch_size=4, num_workers=self.workers)
            if self.partitions is not None:
                return torchrepro.SeededLoader(
                    shards(),
                    batch_size=4,
                    global_batch_size=8,
                    drop_last=True,
                    partitions=self.partitions,
                    num_workers=self.workers,
                    shuffle_buffer=8,
                )
            return torchrepro.SeededLoader(shards(), batch_size=4, num_workers=self.workers, shuffle_buffer=8)
        data = NoisyPoints(32)
        if self.variant == "stock":
            return DataLoader(data, batch_size=4, shuffle=True, num_workers=self.workers)
        return torchrepro.SeededLoader(data, batch_size=4, num_workers=self.workers)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(NoisyPoints(8), batch_size=4)


class KillAt(pl.Callback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--variant", choices=["torchrepro", "stock"], default="torchrepro")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--partitions", type=int, default=None)
    args = parser.parse_args(argv)
    global READS
    READS = args.out
    warnings.filterwarnings("ignore", category=PossibleUserWarning)  # few workers, few batches
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    callbacks: list[pl.Callback] = [KillAt(args.kill_at)]
    if args.variant == "stock":
        pl.seed_everything(SEED, verbose=False)
    else:
        torchrepro.seed_everything(SEED)  # before the model is built: same initial weights
        callbacks.append(TorchreproCallback(seed=SEED))
    model = Net(args.variant, args.workers, args.stream, args.partitions)
    callbacks.append(
        ModelCheckpoint(
            dirpath=args.out / "ckpt", every_n_train_steps=args.every, save_last=True, save_top_k=-1
        )
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        limit_train_batches=args.limit,
    )
    trainer.fit(model, ckpt_path=args.resume)
    (args.out / f"mode.rank{trainer.global_rank}.txt").write_text(torchrepro.status().mode)
    if trainer.is_global_zero:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out / "final.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
