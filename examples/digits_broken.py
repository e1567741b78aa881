"""``digits_train.py`` with one reproducibility bug: a noise layer seeded from the clock.

The "regularising" noise draws from its own ``torch.Generator``, seeded with the time in
nanoseconds when the model is built: global seeding never reaches it, so two runs part at the
first optimizer step. ``torchrepro check examples/digits_broken.py`` reports a ``compute``
divergence at step 0 and, when op tracing is available, the op, module and line of the draw.
"""

from __future__ import annotations

import time

import torch
from digits_train import Digits, Net
from torch import nn
from torch.nn import functional as F


class ClockNoise(nn.Module):
    """Adds small Gaussian noise in training from a generator seeded by the clock (the bug)."""

    def __init__(self, std: float = 0.05) -> None:
        super().__init__()
        self.std = std
        self.gen = torch.Generator().manual_seed(time.time_ns())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return x + self.std * torch.randn(x.shape, generator=self.gen)


class NoisyNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.noise = ClockNoise()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = self.noise(x)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(self.drop(x.flatten(1)))


def main() -> None:
    loader = torch.utils.data.DataLoader(Digits(384), batch_size=32, shuffle=True, num_workers=2)
    model = NoisyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        total = 0.0
        for images, labels in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            opt.step()
            total += loss.item()
        print(f"epoch {epoch}: mean loss {total / len(loader):.4f}")


if __name__ == "__main__":
    main()
