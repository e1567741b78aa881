"""A small CNN on generated 8x8 digit images, trained as an ordinary script would.

Nothing here is torchrepro-specific: random augmentation runs in DataLoader workers (global torch
RNG inside ``__getitem__``), the model has dropout, the loader shuffles. Run it under
``torchrepro check examples/digits_train.py`` to verify it is bit-for-bit reproducible;
``examples/digits_broken.py`` is the same script with one reproducibility bug.

    python examples/digits_train.py [--epochs N] [--workers N]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F

# 5x3 glyphs of the digits 0-9, one string of 15 pixels per digit (row major).
GLYPHS = [
    "111101101101111",
    "010110010010111",
    "111001111100111",
    "111001111001111",
    "101101111001001",
    "111100111001111",
    "111100111101111",
    "111001010010010",
    "111101111101111",
    "111101111001111",
]


def make_digits(n: int, *, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy 8x8 images of digits and their labels (fixed by ``seed``: the "dataset")."""
    g = torch.Generator().manual_seed(seed)
    glyphs = torch.tensor([[float(c) for c in s] for s in GLYPHS]).view(10, 1, 5, 3)
    glyphs = F.interpolate(glyphs, size=(6, 5), mode="nearest")
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.zeros(n, 1, 8, 8)
    for i, label in enumerate(labels.tolist()):
        r, c = torch.randint(0, 3, (2,), generator=g).tolist()
        images[i, :, r : r + 6, c : c + 5] = glyphs[label]
    images += 0.2 * torch.randn(images.shape, generator=g)
    return images, labels


class Digits(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The digits with random augmentation: a random 1-pixel roll and pixel noise."""

    def __init__(self, n: int) -> None:
        self.images, self.labels = make_digits(n)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        shift = torch.randint(-1, 2, (2,)).tolist()
        image = torch.roll(self.images[i], shifts=shift, dims=(1, 2))
        return image + 0.1 * torch.randn_like(image), self.labels[i]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(self.drop(x.flatten(1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=384)
    args = parser.parse_args()

    loader = torch.utils.data.DataLoader(
        Digits(args.samples), batch_size=32, shuffle=True, num_workers=args.workers
    )
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.epochs):
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
