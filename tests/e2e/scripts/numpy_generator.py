"""A dataset holding an unseeded NumPy Generator: global seeding never reaches it."""

import numpy as np
import torch
from torch import nn


class Jitter(torch.utils.data.Dataset):
    def __init__(self):
        self.rng = np.random.default_rng()  # unseeded: fresh OS entropy every process

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.from_numpy(self.rng.normal(size=4).astype("float32"))


torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for xb in torch.utils.data.DataLoader(Jitter(), batch_size=4):
    opt.zero_grad()
    model(xb).pow(2).mean().backward()
    opt.step()
