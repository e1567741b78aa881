"""DDP on gloo where only rank 1 scales its activations by a process-dependent factor: two runs
part at rank 1 (``torchrepro compare`` must name rank 1, its node and this line). With
``--sleep S`` every step first waits S seconds (a run long enough to kill a node in); with
``--steady`` rank 1 does not wobble (the same script, reproducible: the negative control)."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


class Wobble(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1 and "--steady" not in sys.argv:
            x = x * (1.0 + (os.getpid() % 1013) * 1e-6)  # nodes: rank 1 mul
        return x


sleep = float(sys.argv[sys.argv.index("--sleep") + 1]) if "--sleep" in sys.argv else 0.0
steps = 1000 if sleep else 3
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 6), Wobble(), nn.Linear(6, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(steps):
    time.sleep(sleep)
    x = torch.randn(8, 4)
    ((model(x) - 1.0) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
