"""An MLP of blocks (Linear, LayerNorm, GELU, dropout) trained with AdamW and gradient clipping on
global batches of 8 micro-batches of 2 samples, under FSDP2 (``fully_shard`` per block and at the
root) or unsharded, with InvariantDataParallel or stock FSDP2.

python fsdp_train.py OUT.json --modes fsdp,unsharded,stock,torchclip,mixed [--save DIR] [--resume DIR]
    fsdp       InvariantDataParallel over FSDP2, torchrepro.clip_grad_norm_
    unsharded  InvariantDataParallel over the plain module, torchrepro.clip_grad_norm_
    stock      stock FSDP2, gradient accumulation (loss / A, gradient sync on the last micro-batch),
               torch's clip_grad_norm_ (the negative control)
    torchclip  InvariantDataParallel over FSDP2 with torch's clip_grad_norm_ (the clipping control)
    mixed      fsdp with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
    clip       clip_fsdp.py's comparison of torchrepro's and torch's clipping (sharded when W > 1)
--save DIR: fsdp saves a (DCP-sharded) checkpoint after every optimizer step; --resume DIR: then, for
each checkpoint in DIR, fsdp on this world size resumed from it and trained to the end.
Each mode starts from the global RNG state a fresh process has and builds its model from seed 0.
Runs under torchrun (gloo, 1 thread per rank) or as a plain process (a process group of one).
Rank 0 writes OUT: per mode, the fingerprint of the full parameters and optimizer state on every
rank (sharded tensors gathered whole, so sharded and unsharded runs compare) and the clipping
norms' bits per step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

import torchrepro

torch.set_num_threads(1)
MICRO, GLOBAL, SAMPLES, WIDTH, MAX_NORM = 2, 16, 48, 12, 0.05


class Features(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 5, generator=g)
        self.y = torch.randint(0, 3, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(5), self.y[i]  # keyed per sample by SeededLoader


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(nn.functional.gelu(self.norm(self.linear(x))))


def build_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, WIDTH), Block(), Block(), nn.Linear(WIDTH, 3))


def shard(net: nn.Module, mixed: bool = False) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in (net[1], net[2]):
        fully_shard(block, **kwargs)
    fully_shard(net, **kwargs)
    return net


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fingerprint(net: nn.Module, opt: torch.optim.Optimizer) -> str:
    params = {name: whole(p.detach()) for name, p in net.named_parameters()}
    state = {
        name: {k: whole(v) for k, v in opt.state[p].items()}
        for name, p in net.named_parameters()
        if p in opt.state
    }
    return torchrepro.fingerprint({"params": params, "opt": state})


def bits(norm: torch.Tensor) -> str:
    return float(whole(norm).double()).hex()


def run(mode: str, save: str | None = None, resume: Path | None = None) -> tuple[str, list[str]]:
    net = build_net()
    if mode in ("fsdp", "torchclip", "stock", "mixed"):
        shard(net, mixed=mode == "mixed")
    loader = torchrepro.SeededLoader(Features(), batch_size=MICRO, global_batch_size=GLOBAL, seed=0)
    model = net if mode == "stock" else torchrepro.InvariantDataParallel(net, loader)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    clip = torch.nn.utils.clip_grad_norm_ if mode in ("stock", "torchclip") else torchrepro.clip_grad_norm_
    a = loader.accumulation_steps
    norms: list[str] = []
    step = 0
    if resume is not None:
        step = torchrepro.load_checkpoint(resume, model=net, optimizer=opt, loader=loader)["step"]
    loader.set_epoch(0)
    for i, (x, y) in enumerate(loader):
        last = (i + 1) % a == 0
        loss = nn.functional.cross_entropy(model(x), y)
        if mode == "stock":
            net.set_requires_gradient_sync(last)
            loss = loss / a
        loss.backward()
        if last:
            norms.append(bits(clip(model.parameters(), MAX_NORM)))
            opt.step()
            opt.zero_grad()
            step += 1
            if save:
                path = Path(save) / f"step-{step}.pt"
                torchrepro.save_checkpoint(path, model=net, optimizer=opt, loader=loader, step=step)
    return fingerprint(net, opt), norms


def gathered(value: str) -> list[str]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--modes", default="fsdp")
    parser.add_argument(
        "--save", help="fsdp mode: a checkpoint after every optimizer step, into this directory"
    )
    parser.add_argument("--resume", help="then, for each checkpoint in this directory: fsdp resumed from it")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # one process: a process group of one (FSDP2 needs a mesh)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    fresh = torch.get_rng_state()
    result: dict[str, object] = {}
    for mode in [m for m in args.modes.split(",") if m != "clip"]:
        torch.set_rng_state(fresh)
        final, norms = run(mode, save=args.save if mode == "fsdp" else None)
        result[mode] = {"final": gathered(final), "norms": norms}
    if "clip" in args.modes.split(","):  # clip_fsdp.py's comparison, in this launch
        from clip_fsdp import clip_both  # type: ignore[import-not-found]  # beside this script

        sharded = dist.get_world_size() > 1  # one process: the whole model (DDP's view)
        result["clip"] = {str(dtype): clip_both(dtype, sharded) for dtype in (torch.float32, torch.float64)}
    for path in sorted(Path(args.resume).glob("step-*.pt")) if args.resume else []:
        torch.set_rng_state(fresh)
        result[f"resumed:{path.name}"] = {"final": gathered(run("fsdp", resume=path)[0])}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
