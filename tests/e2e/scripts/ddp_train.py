"""2-rank DDP on gloo, no seeding of its own; each rank reads its own shard."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=True)
for xb, yb in torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler):
    opt.zero_grad()
    ((model(xb) - yb) ** 2).mean().backward()
    opt.step()
dist.destroy_process_group()
