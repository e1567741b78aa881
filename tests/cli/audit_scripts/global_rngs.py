"""Datasets that draw from the global RNGs, with and without the script seeding them (audit fixture).

``python global_rngs.py``: the seed itself comes from an unseeded ``random.randint``, and Python's
random and NumPy's global RNG are never seeded. ``python global_rngs.py seeded``: every global RNG
is seeded with a constant. A FakeData-like dataset seeds torch per index (never a finding), and a
loader is given a ``RandomSampler`` without a generator.
"""

import random
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler


class Flip(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.arange(4.0) + i
        return x.flip(0) if random.random() < 0.5 else x  # Python's global random


class Jitter(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i)) + float(np.random.uniform(-0.1, 0.1))  # NumPy's global RNG


class FakeData(Dataset[torch.Tensor]):
    """Like torchvision's FakeData: seeds torch per index and restores the RNG state."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        state = torch.get_rng_state()
        torch.manual_seed(i + 1000)
        x = torch.randn(4)
        torch.set_rng_state(state)
        return x


if sys.argv[1:] == ["seeded"]:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
else:
    seed = random.randint(0, 2**31 - 1)
    torch.manual_seed(seed)
torch.set_num_threads(1)

flips = DataLoader(Flip(), batch_size=4)
jitters = DataLoader(Jitter(), batch_size=4)
fakes = DataLoader(FakeData(), batch_size=4)
sampled = DataLoader(FakeData(), batch_size=4, sampler=RandomSampler(range(8)), generator=torch.Generator())

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for loader in (flips, jitters, fakes, sampled):
    (batch,) = [next(iter(loader))]
    loss = model(batch).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
