"""A hand-written update loop (no torch.optim) whose dropout is reseeded from os.urandom at step 2."""

import os

import torch
from torch import nn

model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 1))
x = torch.randn(16, 6)
for step in range(4):
    if step == 2:
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    loss = model(x).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    model.zero_grad()
