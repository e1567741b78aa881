"""A small CNN (convolution, BatchNorm, dropout, linear) trained for 3 steps on random data.

On the CPU its gradients change with the thread count (oneDNN's convolution backward, oneMKL's
GEMMs split their sums by thread); in portable mode (``--portable``) they are the same at 1 and
2 threads."""

import torch
from torch import nn
from torch.nn import functional as F

model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1),
    nn.BatchNorm2d(16),
    nn.ReLU(),
    nn.Dropout(0.2),
    nn.Conv2d(16, 32, 3, padding=1),
    nn.ReLU(),
    nn.AdaptiveAvgPool2d(4),
    nn.Flatten(),
    nn.Linear(512, 10),
)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
