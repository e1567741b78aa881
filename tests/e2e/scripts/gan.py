"""A GAN, as DCGAN writes it: netG and netD each hold their layers as ``main``, so both have a
parameter ``main.0.weight``; each iteration steps optimizerD (created first: ``optimizer0``) and
then optimizerG. 3 iterations are 3 training steps and 6 optimizer steps.
``--noisy``: the real samples netD sees get noise from a generator seeded by ``os.urandom``."""

import os
import sys

import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


netG, netD = Generator(), Discriminator()
optimizerD = torch.optim.Adam(netD.parameters(), lr=1e-3)
optimizerG = torch.optim.Adam(netG.parameters(), lr=1e-3)
criterion = nn.BCEWithLogitsLoss()
noisy = "--noisy" in sys.argv
noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little")) if noisy else None
real, ones, zeros = torch.randn(16, 2) + 1.0, torch.ones(16, 1), torch.zeros(16, 1)
for _ in range(3):
    x = real if noise is None else real + 0.01 * torch.randn(real.shape, generator=noise)
    fake = netG(torch.randn(16, 4))
    optimizerD.zero_grad()
    (criterion(netD(x), ones) + criterion(netD(fake.detach()), zeros)).backward()
    optimizerD.step()
    optimizerG.zero_grad()
    criterion(netD(fake), ones).backward()
    optimizerG.step()
