"""Rank 0 forks rank 1 (``multiprocessing``'s fork start method) and both train with gloo.

A forked process is no new interpreter: torchrepro cannot configure it, and the recorder it
inherits stays silent there. ``--noisy``: rank 1's samples get unseeded noise.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Points, model, train


def rank_main(rank: int, port: int, noisy: bool) -> None:
    torch.set_num_threads(1)
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
    noisy = "--noisy" in sys.argv
    child = multiprocessing.get_context("fork").Process(target=rank_main, args=(1, port, noisy))
    child.start()
    rank_main(0, port, noisy)
    child.join()
    sys.exit(child.exitcode)
