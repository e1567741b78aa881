"""Trains on a ShardedDataset, through a streamed SeededLoader (argv[1] == "seeded", 2 workers)
or through a plain DataLoader over the same IterableDataset (argv[1] == "plain", 2 workers)."""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

import torchrepro


def read(n):
    g = torch.Generator().manual_seed(n)
    for _ in range(n):
        yield torch.randn(5, generator=g) + 0.1 * torch.randn(5), torch.randn(1, generator=g)


ds = torchrepro.ShardedDataset([10, 13, 7, 20], read)
if sys.argv[1] == "seeded":
    loader = torchrepro.SeededLoader(ds, batch_size=4, seed=0, shuffle_buffer=8, num_workers=2)
else:
    loader = DataLoader(ds, batch_size=4, num_workers=2)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(5, 4), nn.Dropout(0.3), nn.Linear(4, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
