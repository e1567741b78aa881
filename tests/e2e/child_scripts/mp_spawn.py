"""Two gloo ranks started by ``torch.multiprocessing.spawn`` (the script starts its own ranks).

Each rank builds its data and model from the global RNG, trains a DDP model, and all-reduces
gradients. ``--noisy``: rank 1's samples get unseeded noise.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Points, model, train


def rank_main(rank: int, port: int, noisy: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    data = Points(noisy=noisy and rank == 1)
    net = DistributedDataParallel(model())
    train(net, DataLoader(data, batch_size=4, shuffle=True))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(1)
    mp.spawn(rank_main, args=(port, "--noisy" in sys.argv), nprocs=2)
