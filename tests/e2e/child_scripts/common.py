"""What the child-rank scripts share: a tiny dataset and model drawn from the global torch RNG.

``NOISY_RANK`` (``--noisy``): that rank adds noise from a generator seeded by ``os.urandom`` to
every sample, randomness no seeding reaches (the negative control).
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """16 random points (drawn from the global RNG when built); ``noisy``: fresh noise per sample."""

    def __init__(self, *, noisy: bool = False) -> None:
        self.x = torch.randn(16, 4)
        self.y = torch.randn(16, 1)
        self.noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little")) if noisy else None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.noise is not None:
            x = x + torch.randn(4, generator=self.noise)
        return x, self.y[i]


def model() -> torch.nn.Module:
    """A tiny MLP with dropout (its init and its masks draw from the global RNG)."""
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1)
    )


def train(net: torch.nn.Module, loader: torch.utils.data.DataLoader, steps: int = 3) -> None:  # type: ignore[type-arg]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    done = 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            done += 1
            if done == steps:
                return


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ddp_rank(rank: int, port: int, noisy: bool) -> None:
    """One of two gloo ranks: DDP training on its data (``noisy``: rank 1 adds unseeded noise)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    data = Points(noisy=noisy and rank == 1)
    net = DistributedDataParallel(model())
    train(net, DataLoader(data, batch_size=4, shuffle=True))
    dist.barrier()
    dist.destroy_process_group()
