"""Training in processes ``torch.multiprocessing.spawn`` starts (audit fixture).

``python spawned.py``: each child seeds torch itself and trains its own model (the parent seeds
nothing). ``python spawned.py unseeded``: the children seed nothing. ``python spawned.py idle``:
the children only build a model (no training anywhere).
"""

import sys

import torch
import torch.multiprocessing as mp


def train(rank: int, mode: str) -> None:
    if mode != "unseeded":
        torch.manual_seed(rank)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    if mode == "idle":
        return
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mp.spawn(train, args=(sys.argv[1] if sys.argv[1:] else "seeded",), nprocs=2)
