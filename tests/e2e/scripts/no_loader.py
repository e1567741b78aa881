"""Training on tensors, without a DataLoader: --vary workers has nothing to vary."""

import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32, 1)
for start in range(0, 32, 8):
    opt.zero_grad()
    ((model(x[start : start + 8]) - y[start : start + 8]) ** 2).mean().backward()
    opt.step()
