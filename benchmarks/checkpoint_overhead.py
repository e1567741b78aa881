"""Claim: ``save_checkpoint`` + ``load_checkpoint`` cost at most ~1.2x plain ``torch.save`` +
``torch.load`` (+ ``load_state_dict``) of the same state dicts.

Run: ``python benchmarks/checkpoint_overhead.py [--params-m 1 25] [--repeats 5] [--device cpu]``.

For each model size it times, side by side in one run (median of ``--repeats``):
- plain: ``torch.save({"model": ..., "optimizer": ..., "scheduler": ..., "step": n}, path)``, then
  ``torch.load(path, weights_only=True)`` and ``load_state_dict`` into fresh objects;
- torchrepro: ``save_checkpoint(path, model=..., optimizer=..., scheduler=..., step=n)`` then
  ``load_checkpoint(path, model=..., optimizer=..., scheduler=...)`` into fresh objects, which
  also captures/restores every RNG, writes atomically (temp file, fsync, rename) and verifies
  every restored state against its fingerprint;
- torchrepro without fsync (``os.fsync`` replaced by a no-op for that column only), to show how
  much of the cost is durability: plain ``torch.save`` does not fsync, so that is the
  like-for-like comparison, and the fsync column is the honest price of a crash-safe file;
- torchrepro with ``verify=False`` on load (fingerprints still computed when saving).
Ratios are against plain. The machine may be shared: the figures are noisy, compare in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchrepro import load_checkpoint, save_checkpoint


def build(n_params_m: float, device: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """An MLP of about ``n_params_m`` million parameters, SGD-momentum state, a scheduler."""
    width = 1024
    layers = max(1, round(n_params_m * 1e6 / (width * width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, width, device=device)).sum().backward()
    opt.step()  # creates the momentum buffers
    # save_checkpoint also stores the gradients a module holds (a save inside an accumulation
    # window needs them); after zero_grad there are none, like what plain torch.save of the
    # state dicts writes, so both sides write the same state.
    opt.zero_grad(set_to_none=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    return model, opt, sched


@contextlib.contextmanager
def no_fsync() -> Iterator[None]:
    real = os.fsync
    os.fsync = lambda fd: None
    try:
        yield
    finally:
        os.fsync = real


def timed(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(n: float, device: str, repeats: int, tmp: Path) -> str:
    """One row: the four timings for a model of ``n`` million parameters."""
    model, opt, sched = build(n, device)
    model2, opt2, sched2 = build(n, device)
    plain_path, repro_path = tmp / "plain.pt", tmp / "repro.pt"

    def plain() -> None:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
        torch.save({**state, "step": 10}, plain_path)
        loaded = torch.load(plain_path, map_location="cpu", weights_only=True)
        model2.load_state_dict(loaded["model"])
        opt2.load_state_dict(loaded["optimizer"])
        sched2.load_state_dict(loaded["scheduler"])

    def repro(verify: bool = True) -> None:
        save_checkpoint(repro_path, model=model, optimizer=opt, scheduler=sched, step=10)
        load_checkpoint(repro_path, model=model2, optimizer=opt2, scheduler=sched2, verify=verify)

    def repro_no_fsync() -> None:
        with no_fsync():
            repro()

    plain()
    repro()  # warm up both paths (imports, page cache)
    t_plain = timed(plain, repeats)
    t_repro = timed(repro, repeats)
    t_nofsync = timed(repro_no_fsync, repeats)
    t_noverify = timed(lambda: repro(verify=False), repeats)
    n_real = sum(p.numel() for p in model.parameters()) / 1e6
    mb = repro_path.stat().st_size / 2**20
    return (
        f"{n_real:7.1f}M {mb:6.0f} | {t_plain:8.3f} | {t_repro:8.3f} {t_repro / t_plain:6.2f} | "
        f"{t_nofsync:10.3f} {t_nofsync / t_plain:6.2f} | "
        f"{t_noverify:11.3f} {t_noverify / t_plain:6.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--params-m", type=float, nargs="+", default=[1.0, 25.0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}")
    print(
        f"{'params':>8} {'MB':>6} | {'plain s':>8} | {'repro s':>8} {'ratio':>6} | "
        f"{'no-fsync s':>10} {'ratio':>6} | {'no-verify s':>11} {'ratio':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.params_m:
            print(bench(n, args.device, args.repeats, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
