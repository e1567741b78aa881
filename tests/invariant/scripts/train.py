"""A CNN with dropout and BatchNorm on an augmenting dataset, trained on global batches of 12
micro-batches of 2 samples: by InvariantDataParallel (and its negative controls), or by stock DDP
with DistributedSampler and gradient accumulation.

python train.py OUT.json --mode invariant|nokey|plainsum|ddp --opt sgd|adam [--workers N]
    [--save DIR] (a checkpoint after every optimizer step) [--resume DIR] (after the run, for every
    checkpoint in DIR: a fresh model resumed from it, trained to the end: the final state of each)
    [--also ddp,nokey,plainsum,adam,workers] (then, in the same processes, each of these runs from
    the global RNG state a fresh process has: a mode with SGD; ``adam``, the invariant run with
    Adam; ``workers``, the invariant run with SGD loading through 2 worker processes; a launch is
    seconds of process start-up, these runs milliseconds)
Works under torchrun (gloo, 1 thread per rank) and as a plain process (no process group).
Rank 0 writes OUT: the final state's fingerprint on every rank, and per resumed checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import torchrepro

torch.set_num_threads(1)
MICRO, GLOBAL, SAMPLES, EPOCHS = 2, 24, 48, 2


class Augmented(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 1, 6, 6, generator=g)
        self.y = torch.randint(0, 3, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        x = self.x[i] + 0.1 * torch.randn(1, 6, 6)  # the global RNG: seeded per sample by SeededLoader
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, self.y[i]


def build_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(64, 3),
    )


def build_opt(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def fingerprint(net: nn.Module, opt: torch.optim.Optimizer) -> str:
    return torchrepro.fingerprint({"model": net.state_dict(), "opt": opt.state_dict()["state"]})


def gathered(value: str) -> list[str]:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out  # type: ignore[return-value]


def invariant_run(args, resume: Path | None = None) -> str:
    net = build_net()
    loader = torchrepro.SeededLoader(
        Augmented(), batch_size=MICRO, global_batch_size=GLOBAL, seed=0, num_workers=args.workers
    )
    model = torchrepro.InvariantDataParallel(net, loader)
    model._keyed = args.mode != "nokey"
    model._plain_sum = args.mode == "plainsum"
    opt = build_opt(args.opt, model.parameters())
    step, start_epoch = 0, 0
    if resume is not None:
        values = torchrepro.load_checkpoint(resume, model=net, optimizer=opt, loader=loader)
        step, start_epoch = values["step"], values["epoch"]
    for epoch in range(start_epoch, EPOCHS):
        loader.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            nn.functional.cross_entropy(model(x), y).backward()
            if (i + 1) % loader.accumulation_steps == 0:
                opt.step()
                opt.zero_grad()
                step += 1
                if args.save:
                    path = Path(args.save) / f"step-{step}.pt"
                    objects = {"model": net, "optimizer": opt, "loader": loader}
                    torchrepro.save_checkpoint(path, **objects, step=step, epoch=epoch)
    return fingerprint(net, opt)


def ddp_run(args) -> str:
    net = build_net()
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = nn.parallel.DistributedDataParallel(net) if dist.is_initialized() else net
    rank = dist.get_rank() if world > 1 else 0
    sampler = DistributedSampler(Augmented(), num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(Augmented(), batch_size=MICRO, sampler=sampler, num_workers=args.workers)
    accumulation = GLOBAL // MICRO // world
    opt = build_opt(args.opt, model.parameters())
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % accumulation == 0
            if last or not dist.is_initialized():
                loss = nn.functional.cross_entropy(model(x), y) / accumulation
                loss.backward()
            else:
                with model.no_sync():
                    (nn.functional.cross_entropy(model(x), y) / accumulation).backward()
            if last:
                opt.step()
                opt.zero_grad()
    return fingerprint(net, opt)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", default="invariant", choices=["invariant", "nokey", "plainsum", "ddp"])
    parser.add_argument("--opt", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--also", default="", help="comma-separated: ddp, nokey, plainsum, adam, workers")
    args = parser.parse_args()
    fresh = torch.get_rng_state()  # what each --also run starts from
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    result: dict[str, object] = {}
    if args.mode == "ddp":
        result["final"] = gathered(ddp_run(args))
    else:
        result["final"] = gathered(invariant_run(args))
    if args.resume:
        checkpoints = sorted(Path(args.resume).glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
        result["resumed"] = {p.name: gathered(invariant_run(args, p)) for p in checkpoints}
    also: dict[str, list[str]] = {}
    for extra in filter(None, args.also.split(",")):
        torch.set_rng_state(fresh)
        options = {**vars(args), "mode": extra, "opt": "sgd", "save": None}
        if extra == "adam":
            options.update(mode="invariant", opt="adam")
        elif extra == "workers":
            options.update(mode="invariant", workers=2)
        run = argparse.Namespace(**options)
        also[extra] = gathered(ddp_run(run) if run.mode == "ddp" else invariant_run(run))
    result["also"] = also
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
