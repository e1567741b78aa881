"""A functional update: gradients from ``torch.autograd.grad``, the weights updated in place.
No optimizer and no ``backward()``: the recorder sees no training step, only the state at exit.
``--noisy``: the batches come from a generator seeded by ``os.urandom``."""

import os
import sys

import torch
from torch import nn

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
seed = int.from_bytes(os.urandom(8), "little") if "--noisy" in sys.argv else 0
batches = torch.Generator().manual_seed(seed)
for _ in range(5):
    loss = model(torch.randn(8, 4, generator=batches)).pow(2).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.sub_(0.1 * g)
