"""Bug: the augmentation draws from a NumPy Generator made without a seed (fresh OS entropy in
every process): seeding the global RNGs never reaches it."""

import numpy as np
import torch
from torch import nn


class Jittered(torch.utils.data.Dataset):
    def __init__(self):
        self.rng = np.random.default_rng()  # the bug: no seed
        self.x = torch.linspace(-1, 1, 64).reshape(16, 4)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + torch.from_numpy(self.rng.normal(0, 0.1, 4).astype("float32"))


model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for xb in torch.utils.data.DataLoader(Jittered(), batch_size=4):
    opt.zero_grad()
    model(xb).pow(2).mean().backward()
    opt.step()
