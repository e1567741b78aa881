"""2-rank DDP on gloo where only rank 1 scales its activations by a process-dependent factor."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Wobble(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            x = x * (1.0 + (os.getpid() % 1013) * 1e-6)  # locate: rank 1 mul
        return x


dist.init_process_group("gloo")
model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 6), Wobble(), nn.Linear(6, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(1 + dist.get_rank())
x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
for _ in range(2):
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
dist.destroy_process_group()
