"""Clean twin: the same memory bank with deterministic algorithms on: index_put_ then sorts the
ids, and the last view of each sample wins in every run."""

import torch
from torch import nn

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)  # the fix: a deterministic index_put_
encoder = nn.Linear(8, 64)
opt = torch.optim.SGD(encoder.parameters(), lr=0.1)
bank = torch.zeros(32768, 64)  # one row per sample
for _ in range(8):
    ids = torch.randperm(32768)
    ids = torch.cat([ids, ids[torch.randperm(32768)]])  # two views of every sample, shuffled
    feats = encoder(torch.randn(65536, 8))
    bank[ids] = feats.detach()
    opt.zero_grad()
    (feats - bank[ids]).pow(2).mean().backward()
    opt.step()
