"""A small segmentation net, as written first and as fixed after ``torchrepro audit``.

    torchrepro audit examples/audit_example.py            # 1 error: adaptive pooling's CUDA backward
    torchrepro audit examples/audit_example.py --fixed    # 0 errors: the replacements the audit suggests

The first version uses reflection padding, adaptive average pooling to 4x4 and bilinear upsampling.
Adaptive pooling's backward has no deterministic CUDA kernel, so under strict mode the script raises
on a GPU, and without it the gradients differ from run to run. PyTorch documents the other two as
raising as well, but on torch 2.11 a GPU ran them deterministically under strict mode (the audit
reports them as info, citing that measurement). ``--fixed`` applies the fixes the audit
prints: replication padding, a fixed average pooling (the input size is a multiple of 4), and
nearest upsampling followed by a convolution. Both versions have the same number of parameters.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class SegNet(nn.Module):
    def __init__(self, *, fixed: bool = False, classes: int = 3) -> None:
        super().__init__()
        self.fixed = fixed
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.pad = nn.ReplicationPad2d(1) if fixed else nn.ReflectionPad2d(1)
        self.body = nn.Conv2d(8, 8, 3)
        self.pool = nn.AvgPool2d(4) if fixed else nn.AdaptiveAvgPool2d(4)
        self.smooth = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(8, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = torch.relu(self.body(self.pad(h)))
        h = self.pool(h)
        mode = "nearest" if self.fixed else "bilinear"
        h = F.interpolate(h, size=x.shape[-2:], mode=mode)
        return self.head(torch.relu(self.smooth(h)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="use the deterministic replacements")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = SegNet(fixed=args.fixed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        images = torch.randn(4, 3, 16, 16)
        masks = torch.randint(0, 3, (4, 16, 16))
        # per-pixel loss flattened to 2-d: the 1-d NLL kernel is deterministic (the 2-d one is not)
        logits = model(images).movedim(1, -1).reshape(-1, 3)
        loss = F.cross_entropy(logits, masks.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
