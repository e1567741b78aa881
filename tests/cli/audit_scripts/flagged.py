"""A small segmentation-style net whose backward has no deterministic CUDA kernel (audit fixture).

Some of its ops torch's documentation lists as raising under strict mode on CUDA, where a GPU run
measured them deterministic under strict mode (reflection padding 2-d, bilinear upsampling, cumsum):
the audit reports those as info, citing the measurement.
"""

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
        h = self.pad(h)  # reflection padding 2-d: strict mode makes its backward deterministic (measured)
        h = torch.relu(self.conv(h))
        h = self.pool(h)  # adaptive average pooling (not to 1x1): backward raises under strict mode on CUDA
        h = F.interpolate(h, size=(8, 8), mode="bilinear", align_corners=False)  # measured deterministic
        h = h.cumsum(-1)  # floating point cumsum: documented raising, measured deterministic
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
    weights = torch.ones(2).scatter_(0, target, torch.full((2,), 2.0), reduce="multiply")  # raises on CUDA
    middle = x.flatten(1).nanmedian(dim=1)  # median with indices: raises on CUDA (measured)
    loss = F.cross_entropy(model(x).mean((2, 3)), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
