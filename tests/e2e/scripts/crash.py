"""Trains two steps, then raises."""

import torch

w = torch.nn.Parameter(torch.ones(3))
opt = torch.optim.SGD([w], lr=0.1)
for step in range(3):
    opt.zero_grad()
    (w * 2).sum().backward()
    opt.step()
    if step == 1:
        raise ValueError("boom at step 1")
