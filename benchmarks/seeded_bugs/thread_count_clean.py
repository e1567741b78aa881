"""Clean twin: the same LayerNorm with the thread count pinned by the script."""

import torch
from torch import nn

torch.set_num_threads(1)  # the fix: the thread count is part of the recipe

model = nn.Sequential(nn.Linear(64, 4096), nn.LayerNorm(4096), nn.Linear(4096, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 64)
for _ in range(3):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
