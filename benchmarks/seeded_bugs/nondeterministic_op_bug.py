"""Bug: a memory bank written with `bank[ids] = feats` from a batch that holds two augmented views
of every sample, shuffled: each id comes twice, and which view's row wins is a race between CPU
threads (index_put_ without accumulate is nondeterministic by design; with 2 threads most calls
of this size differ). Checked as plain python runs it (the script seeds itself, no torchrepro
settings), with 2 threads; with 1 thread there is no race, and nothing to catch."""

import torch
from torch import nn

torch.manual_seed(0)
encoder = nn.Linear(8, 64)
opt = torch.optim.SGD(encoder.parameters(), lr=0.1)
bank = torch.zeros(32768, 64)  # one row per sample
for _ in range(8):
    ids = torch.randperm(32768)
    ids = torch.cat([ids, ids[torch.randperm(32768)]])  # two views of every sample, shuffled
    feats = encoder(torch.randn(65536, 8))
    bank[ids] = feats.detach()  # the bug: duplicate ids race
    opt.zero_grad()
    (feats - bank[ids]).pow(2).mean().backward()
    opt.step()
