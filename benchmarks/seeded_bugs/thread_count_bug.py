"""Bug: LayerNorm over 4096 features: on the CPU its backward splits a reduction by the thread
count, so a machine with other cores trains other bits (shown by varying the thread count)."""

import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 4096), nn.LayerNorm(4096), nn.Linear(4096, 1))  # the bug: any threads
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 64)
for _ in range(3):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
