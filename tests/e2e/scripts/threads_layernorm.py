"""LayerNorm over 4096 features: on the CPU its backward splits a reduction by the thread count.

With 1 and 2 threads the gradient of the LayerNorm weight differs in its last bits at step 0;
with the same thread count the runs are bitwise equal."""

import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 4096), nn.LayerNorm(4096), nn.Linear(4096, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 64)
for _ in range(3):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
