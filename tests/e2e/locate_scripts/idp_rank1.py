"""3-rank InvariantDataParallel on gloo (6 micro-batches a global batch, 2 per rank) where only
rank 1 scales its activations by a process-dependent factor: rank 0 sees the difference first in
what it receives from rank 1 (the reduction's all-to-all), so the source must be found on rank 1."""

import os

import torch
import torch.distributed as dist
from torch import nn

import torchrepro


class Wobble(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            x = x * (1.0 + (os.getpid() % 1013) * 1e-6)  # locate: rank 1 mul
        return x


dist.init_process_group("gloo")
data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
loader = torchrepro.SeededLoader(data, batch_size=2, global_batch_size=12, seed=0)
model = torchrepro.InvariantDataParallel(nn.Sequential(nn.Linear(4, 6), Wobble(), nn.Linear(6, 1)), loader)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i, (x, y) in enumerate(loader):
    ((model(x) - y) ** 2).mean().backward()
    if (i + 1) % loader.accumulation_steps == 0:
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
