"""A small CNN trained from a DataLoader (``--workers N``); dropout's RNG is re-seeded from
os.urandom before step 1, so the runs part at the dropout call of step 1.

With workers, the main process rebuilds batches from shared memory as they arrive; how many it
rebuilds before a model op depends on timing, so those ops must not be aligned with the model's.
"""

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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


parser = argparse.ArgumentParser()
parser.add_argument("--workers", type=int, default=0)
workers = parser.parse_args().workers

g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(24, 1, 8, 8, generator=g), torch.randint(0, 2, (24,), generator=g))
loader = DataLoader(
    data, batch_size=4, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(0)
)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step, (x, y) in enumerate(loader):
    if step == 1:
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if step == 2:
        break
