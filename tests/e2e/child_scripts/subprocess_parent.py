"""Rank 0 trains here, and starts rank 1 as ``python subprocess_rank.py`` (RANK=1 in its
environment, as a hand-rolled launcher would). ``--no-rank``: the child is started with the
parent's environment as is (a plain child, no rank of its own). ``--noisy`` reaches the child."""

from __future__ import annotations

import os
import subprocess
import sys

from torch.utils.data import DataLoader

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
from common import Points, model, train  # noqa: E402

if __name__ == "__main__":
    env = dict(os.environ) if "--no-rank" in sys.argv else {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    child = [sys.executable, os.path.join(here, "subprocess_rank.py"), *sys.argv[1:]]
    train(model(), DataLoader(Points(), batch_size=4, shuffle=True))
    subprocess.run(child, env=env, check=True)
