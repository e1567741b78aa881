"""A layer multiplies by a factor that depends on the process id: every run differs at step 0."""

import os

import torch
from torch import nn


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 + (os.getpid() % 1009) * 1e-6)  # locate: pid mul


model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.Tanh(), Scale()), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
x, y = torch.randn(16, 6), torch.randn(16, 1)
for _ in range(3):
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
