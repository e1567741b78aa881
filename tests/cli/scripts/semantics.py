"""Reports how it was started, records through every hook, exits with code 3."""

import json
import os
import sys

import torch

import torchrepro

model = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train = torch.utils.data.DataLoader(torch.arange(8.0).view(4, 2), batch_size=2, num_workers=1)
val = torch.utils.data.DataLoader(torch.arange(6.0), batch_size=3)
for _epoch in range(2):
    for xb in train:
        opt.zero_grad()
        model(torch.cat([xb, xb[:, :1]], 1)).sum().backward()
        opt.step()
    for vb in val:
        torchrepro.record("val", vb.sum())
info = {
    "name": __name__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "hashseed": os.environ.get("PYTHONHASHSEED"),
    "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    "initial_seed": torch.initial_seed(),
    "threads": torch.get_num_threads(),
    "deterministic": torch.are_deterministic_algorithms_enabled(),
    "workers": train.num_workers,
}
print("INFO " + json.dumps(info), flush=True)
sys.exit(3)
