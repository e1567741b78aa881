"""Rank 0 forks rank 1 (``multiprocessing``'s fork start method) and both train with gloo.

A forked process is no new interpreter: torchrepro cannot configure it, and the recorder it
inherits stays silent there. ``--noisy``: rank 1's samples get unseeded noise.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ddp_rank, free_port

if __name__ == "__main__":
    port = free_port()
    noisy = "--noisy" in sys.argv
    torch.set_num_threads(1)  # before the fork: the forked rank inherits it
    child = multiprocessing.get_context("fork").Process(target=ddp_rank, args=(1, port, noisy))
    child.start()
    ddp_rank(0, port, noisy)
    child.join()
    sys.exit(child.exitcode)
