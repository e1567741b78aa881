"""A plain Hugging Face ``Trainer`` run that resumes from its newest checkpoint; no torchrepro.

Usage: python hf_resume.py [--resume]      (in the directory it works in; relative paths only)

A small MLP with dropout (returning its loss the way HF models do) on 48 fixed samples, batches of
8: 2 epochs of 6 steps, 12 optimizer steps, on the CPU, ``seed=0``. A full checkpoint (model,
optimizer, scheduler, trainer state, ``rng_state.pth``) goes to ``out/checkpoint-<step>`` after
every step; ``--resume`` trains with ``resume_from_checkpoint=True``, which takes the newest.

- Prints ``START_STEP <n>``: ``state.global_step`` when training begins (0, or the step resumed from).
- Writes the model's final ``state_dict`` to ``final.pt``.
- With ``RESUME_CRASH_AFTER=K`` in the environment it SIGKILLs itself as step K+1 begins, so the
  checkpoint of step K is complete on disk.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import signal
import sys
import warnings
from typing import Any

import torch
import transformers
from torch import nn
from torch.nn import functional as F

warnings.filterwarnings("ignore")


class Points(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """48 fixed samples (the same in every process)."""

    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(nn.Module):
    """A small MLP with dropout, returning the loss the way HF models do."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.3)
        self.l2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.l2(self.drop(torch.relu(self.l1(x)))).squeeze(-1)
        return {"loss": F.mse_loss(out, labels)}


class Probe(transformers.TrainerCallback):
    """Prints ``START_STEP``; SIGKILLs the process as the step after ``crash_after`` begins."""

    def __init__(self, crash_after: int | None) -> None:
        self.crash_after = crash_after

    def on_train_begin(self, args: Any, state: transformers.TrainerState, control: Any, **kw: Any) -> None:
        print(f"START_STEP {state.global_step}", flush=True)

    def on_step_begin(self, args: Any, state: transformers.TrainerState, control: Any, **kw: Any) -> None:
        if state.global_step == self.crash_after:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    crash_after = os.environ.get("RESUME_CRASH_AFTER")

    transformers.set_seed(0)
    model = Net()
    training = transformers.TrainingArguments(
        output_dir="out",
        per_device_train_batch_size=8,
        num_train_epochs=2,
        learning_rate=0.01,
        save_strategy="steps",
        save_steps=1,
        save_only_model=False,
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(
        model=model,
        args=training,
        train_dataset=Points(),
        callbacks=[Probe(int(crash_after) if crash_after else None)],
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():
        torch.save(model.state_dict(), "final.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
