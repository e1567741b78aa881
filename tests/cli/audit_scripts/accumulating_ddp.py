"""Gradient accumulation under stock DDP, as the DDP tutorials write it: ``no_sync`` on all but the
last micro-batch of each step (here one process, so it runs anywhere; the bits it costs show on
several)."""

import os
import socket

import torch
import torch.distributed as dist
from torch import nn

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
torch.manual_seed(0)
net = nn.Linear(4, 2)
data = [(torch.randn(4), 0) for _ in range(8)]
opt = torch.optim.SGD(net.parameters(), lr=0.1)
model = nn.parallel.DistributedDataParallel(net)
loader = torch.utils.data.DataLoader(data, batch_size=2)
for i, (x, y) in enumerate(loader):
    if (i + 1) % 4:
        with model.no_sync():  # accumulate
            (nn.functional.cross_entropy(model(x), y) / 4).backward()
    else:
        (nn.functional.cross_entropy(model(x), y) / 4).backward()
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
