"""Trains forever with DataLoader workers (for the signal test)."""

import sys

import torch

sys.stdout.write("started\n")
sys.stdout.flush()
w = torch.nn.Parameter(torch.ones(3))
opt = torch.optim.SGD([w], lr=0.01)
loader = torch.utils.data.DataLoader(
    torch.arange(1000.0), batch_size=10, num_workers=2, persistent_workers=True
)
while True:
    for xb in loader:
        opt.zero_grad()
        (w.sum() * xb.mean()).backward()
        opt.step()
