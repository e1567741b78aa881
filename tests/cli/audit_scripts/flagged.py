"""A small segmentation-style net whose backward has no deterministic CUDA kernel (audit fixture)."""

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.pad = nn.ReflectionPad2d(1)
        self.conv = nn.Conv2d(4, 4, 3)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = self.pad(h)  # reflection padding: backward raises under strict mode on CUDA
        h = torch.relu(self.conv(h))
        h = self.pool(h)  # adaptive average pooling (not to 1x1): same
        h = F.interpolate(h, size=(8, 8), mode="bilinear", align_corners=False)  # same
        h = h.cumsum(-1)  # floating point cumsum: raises under strict mode on CUDA (forward and backward)
        return self.head(h)


torch.manual_seed(0)
torch.set_num_threads(1)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    x = torch.randn(2, 3, 8, 8)
    target = torch.randint(0, 2, (2,))
    counts = torch.bincount(target, minlength=2)  # without weights: deterministic, no finding
    positions = torch.ones(2, 8, dtype=torch.long).cumsum(1)  # integer cumsum: no finding
    loss = F.cross_entropy(model(x).mean((2, 3)), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
