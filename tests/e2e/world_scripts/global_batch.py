"""A small MLP with BatchNorm and dropout on an augmenting dataset, trained on global batches of 4
micro-batches of 2 samples, the same global batch on any number of processes.

python global_batch.py [--mode invariant|ddp|fsdp|fsdp-stock|none]
- invariant: SeededLoader(global_batch_size=8) and torchrepro.InvariantDataParallel;
- ddp: stock DDP, DistributedSampler and gradient accumulation (global // micro // world steps);
- fsdp: invariant over FSDP2 (fully_shard on the first Linear and at the root);
- fsdp-stock: stock FSDP2, DistributedSampler and gradient accumulation (sync on the last);
- none: trains nothing (evaluates the model on the loader, no optimizer, no backward()).
Works under torchrun (gloo) and as a plain process (no process group; the FSDP2 modes: one of one).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import torchrepro

MICRO, GLOBAL, SAMPLES = 2, 8, 24


class Augmented(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 6, generator=g)
        self.y = torch.randint(0, 3, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]  # the global RNG, seeded per sample


def build_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))


parser = argparse.ArgumentParser()
parser.add_argument("--mode", default="invariant", choices=["invariant", "ddp", "fsdp", "fsdp-stock", "none"])
args = parser.parse_args()
if "RANK" not in os.environ and args.mode.startswith("fsdp"):  # FSDP2 needs a process group
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
if "RANK" in os.environ:
    dist.init_process_group("gloo")
world = dist.get_world_size() if dist.is_initialized() else 1
net = build_net()
if args.mode.startswith("fsdp"):
    from torch.distributed.fsdp import fully_shard

    fully_shard(net[0])
    fully_shard(net)

if args.mode in ("invariant", "fsdp"):
    loader = torchrepro.SeededLoader(Augmented(), batch_size=MICRO, global_batch_size=GLOBAL, seed=0)
    model = torchrepro.InvariantDataParallel(net, loader)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(loader):
        nn.functional.cross_entropy(model(x), y).backward()
        if (i + 1) % loader.accumulation_steps == 0:
            opt.step()
            opt.zero_grad()
elif args.mode in ("ddp", "fsdp-stock"):
    ddp = args.mode == "ddp" and dist.is_initialized()
    model = nn.parallel.DistributedDataParallel(net) if ddp else net
    data = Augmented()
    sampler = DistributedSampler(data, num_replicas=world, rank=dist.get_rank() if world > 1 else 0, seed=0)
    accumulation = GLOBAL // MICRO // world
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(DataLoader(data, batch_size=MICRO, sampler=sampler)):
        if args.mode == "fsdp-stock":
            net.set_requires_gradient_sync((i + 1) % accumulation == 0)
        (nn.functional.cross_entropy(model(x), y) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad()
else:
    net.eval()
    with torch.no_grad():
        for x, _ in DataLoader(Augmented(), batch_size=MICRO):
            net(x)

if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
