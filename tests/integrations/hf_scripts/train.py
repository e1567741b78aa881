"""Train a tiny model with the Hugging Face Trainer; write the final weights of each run.

    python train.py run KIND:WORKERS:DIR [...]        train from scratch, checkpoints every 4 steps
    python train.py resume KIND:WORKERS:CHECKPOINT:DIR [...]   resume from CHECKPOINT

also under ``torchrun --nproc_per_node 2`` (each process its shard).

KIND is ``repro`` (TorchreproTrainer) or ``stock`` (transformers.Trainer) over the map-style
``Noisy``; ``repro-stream``/``stock-stream`` over a ``torchrepro.ShardedDataset`` of 8 shards
(36 samples, one shard empty; read noting the shards opened in ``DIR/reads.<pid>.txt``), and
``repro-hf`` over a ``datasets.IterableDataset`` of 6 shards with a noise ``map``, ``repro-parts``
over the shards in 2 partitions (``TorchreproTrainer(partitions=2)``): batch 4,
accumulation 3, ``max_steps=8``, checkpoints every 2 steps, so an epoch of 9 batches is 3 steps
and checkpoint-6 is at the end of epoch 1. Each run writes
``DIR/final.pt`` (the model's state dict) and, for ``repro``, ``DIR/batches.rank<R>.pt`` (the
inputs of epoch 1 of the train loader, on each process). 44 samples, batch 4, accumulation 2: 11 batches and
6 optimizer steps per epoch (the last with one batch), 2 epochs, 12 steps. The dataset draws a
random augmentation from the global torch RNG in ``__getitem__`` and the model has dropout, so the
data order, the augmentation and the model's RNG stream all show in the weights.
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import noisy
import torch
import transformers
from noisy import Net, Noisy

import torchrepro
from torchrepro.integrations.transformers import TorchreproTrainer


def train(kind: str, workers: int, out: str, checkpoint: str | None) -> None:
    torch.manual_seed(0)
    model = Net()
    data: Any = Noisy()
    schedule: dict[str, Any] = {"gradient_accumulation_steps": 2, "num_train_epochs": 2, "save_steps": 4}
    if kind.endswith(("-stream", "-hf", "-parts")):
        schedule = {"gradient_accumulation_steps": 3, "max_steps": 8, "save_steps": 2}
        noisy.READS = Path(out)
        Path(out).mkdir(parents=True, exist_ok=True)
        data = torchrepro.ShardedDataset(range(len(noisy.SHARD_LENGTHS)), noisy.read_shard)
        if kind.endswith("-hf"):
            data = noisy.hf_stream()
    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        save_strategy="steps",
        **schedule,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=workers,
    )
    cls: Any = TorchreproTrainer if kind.startswith("repro") else transformers.Trainer
    extra: dict[str, Any] = {"shuffle_buffer": 8} if kind == "repro-stream" else {}
    if kind == "repro-parts":  # 2 partitions; a global batch: 4 x 1 process x 3 accumulated
        extra = {"shuffle_buffer": 8, "partitions": 2}
    trainer = cls(model=model, args=args, train_dataset=data, **extra)
    trainer.train(resume_from_checkpoint=checkpoint)
    rank = trainer.args.process_index
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(out, "final.pt"))
    if kind == "repro":  # epoch 1 of the train loader the Trainer iterates, on this process
        loader = trainer.get_train_dataloader()
        loader.set_epoch(1)
        torch.save([batch["x"] for batch in loader], os.path.join(out, f"batches.rank{rank}.pt"))


def main(argv: list[str]) -> None:
    mode, specs = argv[0], argv[1:]
    for spec in specs:
        if mode == "run":
            kind, workers, out = spec.split(":")
            train(kind, int(workers), out, None)
        else:
            kind, workers, checkpoint, out = spec.split(":")
            train(kind, int(workers), out, checkpoint)


if __name__ == "__main__":
    main(sys.argv[1:])
    if torch.distributed.is_initialized():  # under torchrun: the ranks end their gloo group together
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        # Seen once under load (a full suite): rank 0 aborted in interpreter finalization after the
        # group was destroyed ("terminate called without an active exception", torch's gloo
        # teardown: pytorch/pytorch#190489). Every file this script writes is closed by now, and the
        # ranks are done with each other: leave without finalizing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
