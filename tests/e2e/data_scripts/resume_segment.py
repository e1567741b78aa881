"""One segment of a training loop's data in a fresh process: load a position, consume, save.

    python resume_segment.py --out OUT.json [--state-in S.json] [--state-out S.json]
        [--stop EPOCH BATCHES] [--epochs 3] [--num-workers N] [--prefetch-factor K] [--persistent]
        [--plain]

Consumes batches until the loader's position is (EPOCH, BATCHES received in that epoch), or to the
end of --epochs. OUT.json: {"batches": [[epoch, batch, sha256], ...], "loads": calls of
__getitem__ in every process, "state": the position}. --plain is the negative control: a plain
DataLoader after seed_everything, resumed the usual way (re-iterate, throw the first batches away).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import torchrepro
from torchrepro._io import atomic_write_json

SEED = 11


class Augmented(Dataset[torch.Tensor]):
    """Every RNG a dataset may use; counts __getitem__ calls across worker processes."""

    def __init__(self, n: int, *, plain: bool) -> None:
        self.n = n
        self.plain = plain
        self.loads = multiprocessing.Value("q", 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        with self.loads.get_lock():
            self.loads.value += 1
        own = 0.0 if self.plain else torchrepro.sample_rng().random()
        draws = [random.random(), float(np.random.rand()), float(torch.rand(())), own]
        return torch.tensor([float(index), *draws], dtype=torch.float64)


def collate(samples: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(samples) + torch.rand(len(samples), 1, dtype=torch.float64)


def digest(batch: torch.Tensor) -> str:
    return hashlib.sha256(batch.numpy().tobytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--state-in")
    parser.add_argument("--state-out")
    parser.add_argument("--stop", type=int, nargs=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--prefetch-factor", type=int)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()

    dataset = Augmented(38, plain=args.plain)
    kwargs: dict[str, Any] = {"num_workers": args.num_workers, "collate_fn": collate}
    if args.prefetch_factor:
        kwargs["prefetch_factor"] = args.prefetch_factor
    if args.persistent:
        kwargs["persistent_workers"] = True
    state = {"epoch": 0, "batches_consumed": 0}
    if args.state_in:
        with open(args.state_in) as f:
            state = json.load(f)

    batches: list[list[Any]] = []
    if args.plain:
        torchrepro.seed_everything(SEED)
        loader: Any = DataLoader(dataset, batch_size=4, shuffle=True, **kwargs)
        epoch, skip = state["epoch"], state["batches_consumed"]
        position = (epoch, skip)
        while epoch < args.epochs and position != tuple(args.stop or ()):
            for b, batch in enumerate(loader):
                if b < skip:
                    continue  # the usual resume: load the batches again and throw them away
                batches.append([epoch, b, digest(batch)])
                position = (epoch, b + 1)
                if position == tuple(args.stop or ()):
                    break
            else:
                epoch, skip = epoch + 1, 0
        state = {"epoch": position[0], "batches_consumed": position[1]}
    else:
        loader = torchrepro.SeededLoader(dataset, batch_size=4, seed=SEED, **kwargs)
        if args.state_in:
            loader.load_state_dict(state)
        stopped = False
        while not stopped and loader.epoch < args.epochs:
            for batch in loader:
                received = loader.state_dict()["batches_consumed"]
                batches.append([loader.epoch, received - 1, digest(batch)])
                if [loader.epoch, received] == args.stop:
                    stopped = True
                    break
            else:
                if loader.epoch == args.epochs - 1:
                    break
        state = loader.state_dict()
        del loader  # shut workers down before reading the counter
    if args.state_out:
        atomic_write_json(args.state_out, state)
    atomic_write_json(args.out, {"batches": batches, "loads": dataset.loads.value, "state": state})


if __name__ == "__main__":
    main()
