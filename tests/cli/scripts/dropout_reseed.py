"""A small CNN with dropout; ``--reseed-at K`` re-seeds torch from os.urandom before step K."""

import os
import sys

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        h = self.drop(h)  # locate: dropout
        return self.head(h.flatten(1))


reseed_at = int(sys.argv[sys.argv.index("--reseed-at") + 1]) if "--reseed-at" in sys.argv else -1
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 2, (8,))
for step in range(4):
    if step == reseed_at:
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
