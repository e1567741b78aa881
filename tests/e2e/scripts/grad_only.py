"""Gradients differ between runs from the first step, but the parameters do not (yet).

The loss is scaled by ``1 + 2**-20 * (pid % 4096)``: a difference of a few ulps in every gradient
(two runs started together have different process ids). ``--optim sgd0`` (lr 0: parameters never move)
or ``--optim adam`` (lr 1e-6: the update rounds the difference away, Adam's state keeps it).
``--same`` uses a fixed factor instead: the control in which nothing differs.
"""

import os
import sys

import torch
from torch import nn

factor = 1 + 2**-20 * (1 if "--same" in sys.argv else os.getpid() % 4096)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
if "adam" in sys.argv:
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
x, y = torch.randn(64, 6), torch.randn(64, 1)
for _ in range(4):
    opt.zero_grad()
    (((model(x) - y) ** 2).mean() * factor).backward()
    opt.step()
