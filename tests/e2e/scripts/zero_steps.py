"""Builds a model and only evaluates it: no optimizer, no backward(), no DataLoader, nothing recorded.

A check has nothing that changes during training to compare: inconclusive, never a pass."""

import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
with torch.no_grad():
    print(f"mean output {model(torch.randn(32, 8)).mean().item():.6f}")
