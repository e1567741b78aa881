"""A custom autograd Function whose forward is exact but whose backward adds process-dependent noise."""

import os

import torch
from torch import nn


class LeakyClip(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-1.0, 1.0)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad + (os.getpid() % 997) * 1e-7  # locate: noisy backward


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(LeakyClip.apply(self.fc1(x)))


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(12, 5), torch.randn(12, 1)
for _ in range(3):
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
