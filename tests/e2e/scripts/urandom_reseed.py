"""Seeded properly, but re-seeds torch from os.urandom right before optimizer step 5."""

import os

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(16, 8), torch.randn(16, 1)
for step in range(8):
    if step == 5:
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
