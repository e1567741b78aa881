"""Hogwild!, as PyTorch's example: the model lives in shared memory and forked processes train it;
the main process only builds it and waits. No optimizer step or backward() runs in the process
torchrepro records, so only the state at exit shows the training.

``--sequential``: each trainer runs alone, one after the other (no race: the same result every
time). ``--noisy``: each trainer draws its batches from a generator seeded by ``os.urandom``."""

import os
import sys

import torch
import torch.multiprocessing as mp
from torch import nn


def train(model: nn.Module, rank: int, noisy: bool) -> None:
    seed = int.from_bytes(os.urandom(8), "little") if noisy else rank
    batches = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=batches)).pow(2).mean().backward()
        opt.step()


if __name__ == "__main__":
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model.share_memory()
    fork = mp.get_context("fork")
    trainers = [fork.Process(target=train, args=(model, rank, "--noisy" in sys.argv)) for rank in range(2)]
    for trainer in trainers:
        trainer.start()
        if "--sequential" in sys.argv:
            trainer.join()
    for trainer in trainers:
        trainer.join()
