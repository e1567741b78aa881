"""The same training as accumulating_ddp.py through SeededLoader(global_batch_size=...) and
torchrepro.InvariantDataParallel, which accumulates in a fixed order: no accumulation finding."""

import os
import socket

import torch
import torch.distributed as dist
from torch import nn

import torchrepro

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
torch.manual_seed(0)
net = nn.Linear(4, 2)
data = [(torch.randn(4), 0) for _ in range(8)]
opt = torch.optim.SGD(net.parameters(), lr=0.1)
loader = torchrepro.SeededLoader(data, batch_size=2, global_batch_size=8, seed=0)
model = torchrepro.InvariantDataParallel(net, loader)
for i, (x, y) in enumerate(loader):
    nn.functional.cross_entropy(model(x), y).backward()
    if (i + 1) % loader.accumulation_steps == 0:
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
