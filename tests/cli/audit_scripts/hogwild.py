"""Processes training one model in shared memory (audit fixture).

``python hogwild.py [mode]``:
- ``hogwild`` (default): two forked processes train the shared model at the same time;
- ``spawn``: the same with the spawn start method (the model reaches them through shared memory);
- ``parent``: one process trains it while the script's own process trains it too;
- ``one``: a single process trains the shared model (controls follow: nothing to report);
- ``sequential``: two processes train it one after the other (each joined before the next starts);
- ``own``: two processes at once, each training a model of its own.
"""

import sys

import torch
import torch.multiprocessing as mp


def train(model: torch.nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()


def train_own() -> None:
    train(torch.nn.Linear(4, 1))


if __name__ == "__main__":
    mode = sys.argv[1] if sys.argv[1:] else "hogwild"
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    model.share_memory()
    context = mp.get_context("spawn" if mode == "spawn" else "fork")
    if mode == "sequential":
        for _ in range(2):
            p = context.Process(target=train, args=(model,))
            p.start()
            p.join()
    else:
        n = 1 if mode in ("one", "parent") else 2
        target, args = (train_own, ()) if mode == "own" else (train, (model,))
        procs = [context.Process(target=target, args=args) for _ in range(n)]
        for p in procs:
            p.start()  # together
        if mode == "parent":
            train(model)
        for p in procs:
            p.join()
