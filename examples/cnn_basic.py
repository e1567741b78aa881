"""A small CNN with dropout, trained for a few steps on generated data.

    python examples/cnn_basic.py [--seed N] [--steps N] [--save PATH]

Every kind of randomness a real script has: NumPy's global RNG makes the images and labels,
Python's ``random`` flips a batch now and then (augmentation), torch initialises the weights,
shuffles the DataLoader and draws the dropout masks. With ``--seed`` the script calls
``torchrepro.seed_everything`` first; without it nothing is seeded, so two runs differ.
The last line printed is ``fingerprint <hex>`` of the trained parameters.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchrepro


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x).flatten(1)))


def make_dataset(n: int = 256) -> TensorDataset:
    images = np.random.rand(n, 1, 16, 16).astype(np.float32)
    labels = np.random.randint(0, 4, size=n)
    return TensorDataset(torch.from_numpy(images), torch.from_numpy(labels))


def train(steps: int) -> nn.Module:
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(make_dataset(), batch_size=16, shuffle=True)
    step = 0
    while step < steps:
        for images, labels in loader:
            if random.random() < 0.5:
                images = images.flip(-1)
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"step {step} loss {loss.item():.6f}")
            step += 1
            if step == steps:
                break
    return model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=None, help="call torchrepro.seed_everything(SEED) first")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    parser.add_argument("--save", default=None, help="torch.save the trained state_dict to this path")
    args = parser.parse_args()
    if args.seed is not None:
        torchrepro.seed_everything(args.seed)
    model = train(args.steps)
    if args.save:
        torch.save(model.state_dict(), args.save)
    print(f"fingerprint {torchrepro.fingerprint(model)}")


if __name__ == "__main__":
    main()
