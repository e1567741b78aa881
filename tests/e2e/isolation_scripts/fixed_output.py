"""Writes its checkpoint below an output directory given on the command line, which it creates
and refuses to reuse (``os.makedirs`` without ``exist_ok``), like many training scripts."""

import os
import sys

import torch

out = sys.argv[1]
os.makedirs(out)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(8, 16)).sum().backward()
opt.step()
torch.save(model.state_dict(), os.path.join(out, "model.pt"))
