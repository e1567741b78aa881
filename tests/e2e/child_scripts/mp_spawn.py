"""Two gloo ranks started by ``torch.multiprocessing.spawn`` (the script starts its own ranks).

Each rank builds its data and model from the global RNG, trains a DDP model, and all-reduces
gradients. ``--noisy``: rank 1's samples get unseeded noise.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ddp_rank, free_port

if __name__ == "__main__":
    port = free_port()
    torch.set_num_threads(1)
    mp.spawn(ddp_rank, args=(port, "--noisy" in sys.argv), nprocs=2)
