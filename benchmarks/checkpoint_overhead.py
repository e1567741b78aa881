"""Claim: ``save_checkpoint`` + ``load_checkpoint`` cost at most ~1.2x plain ``torch.save`` +
``torch.load`` (+ ``load_state_dict``) of the same state dicts.

Run: ``python benchmarks/checkpoint_overhead.py [--params-m 1 25] [--repeats 4] [--trials 3]
[--device cpu]``.

For each model size it times, side by side in one run, ``--repeats`` rounds in a row of "save a
checkpoint under a new name (``step-<i>.pt``, like a training loop), load it into fresh objects",
and takes the mean per round (the whole series, plus waiting for the last background fsync,
divided by the rounds: a background fsync that the next save waits for is counted where it is
paid). The columns take turns, ``--trials`` times, and the median is reported:
- plain: ``torch.save({"model": ..., "optimizer": ..., "scheduler": ..., "step": n}, path)``, then
  ``torch.load(path, weights_only=True)`` and ``load_state_dict`` into fresh objects;
- default: ``save_checkpoint(path, model=..., optimizer=..., scheduler=..., step=n)`` then
  ``load_checkpoint(path, model=..., optimizer=..., scheduler=...)``, which also captures/restores
  every RNG, writes atomically and verifies every restored state against its checksum; the file
  is complete at its path when the save returns and fsynced in a background thread
  (``durable="background"``);
- durable now: the same with ``durable="now"`` (fsync, rename, fsync of the directory before the
  save returns: the previous default);
- no fsync: the default with ``os.fsync`` replaced by a no-op for that column only, the
  like-for-like comparison with plain ``torch.save`` (which does not fsync).
Ratios are against plain. The machine may be shared: the figures are noisy, compare in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchrepro import load_checkpoint, save_checkpoint
from torchrepro.checkpoint import wait_for_checkpoints


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


def rounds(step: Callable[[Path], None], directory: Path, repeats: int) -> float:
    """Mean seconds per ``step(path)`` over ``repeats`` new paths in ``directory``, counting the
    wait for the last background fsync; a file is deleted once two newer ones exist."""
    directory.mkdir()
    start = time.perf_counter()
    for i in range(repeats):
        step(directory / f"step-{i}.pt")
        old = directory / f"step-{i - 2}.pt"
        if old.exists():
            old.unlink()
    wait_for_checkpoints()
    elapsed = time.perf_counter() - start
    shutil.rmtree(directory)
    return elapsed / repeats


def bench(n: float, device: str, repeats: int, trials: int, tmp: Path) -> str:
    """One row: the four timings for a model of ``n`` million parameters."""
    model, opt, sched = build(n, device)
    model2, opt2, sched2 = build(n, device)

    def plain(path: Path) -> None:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
        torch.save({**state, "step": 10}, path)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        model2.load_state_dict(loaded["model"])
        opt2.load_state_dict(loaded["optimizer"])
        sched2.load_state_dict(loaded["scheduler"])

    def repro(path: Path, durable: str = "background") -> None:
        save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=10, durable=durable)
        load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)

    def repro_no_fsync(path: Path) -> None:
        with no_fsync():
            repro(path)
            wait_for_checkpoints()  # its background thread must not run after fsync is back

    columns: dict[str, Callable[[Path], None]] = {
        "plain": plain,
        "default": repro,
        "now": lambda p: repro(p, durable="now"),
        "nofsync": repro_no_fsync,
    }
    rounds(plain, tmp / "warm-plain", 1)
    rounds(repro, tmp / "warm-repro", 1)  # warm up both paths (imports, page cache)
    times: dict[str, list[float]] = {name: [] for name in columns}
    for trial in range(trials):  # columns interleaved, so a busy moment hits them all alike
        for name, step in columns.items():
            times[name].append(rounds(step, tmp / f"{name}-{trial}", repeats))
    t_plain, t_default, t_now, t_nofsync = (statistics.median(times[name]) for name in columns)
    n_real = sum(p.numel() for p in model.parameters()) / 1e6
    probe = tmp / "size.pt"
    save_checkpoint(probe, model=model, optimizer=opt, scheduler=sched, step=10, durable="now")
    mb = probe.stat().st_size / 2**20
    probe.unlink()
    return (
        f"{n_real:7.1f}M {mb:6.0f} | {t_plain:8.3f} | {t_default:9.3f} {t_default / t_plain:6.2f} | "
        f"{t_now:9.3f} {t_now / t_plain:6.2f} | {t_nofsync:10.3f} {t_nofsync / t_plain:6.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--params-m", type=float, nargs="+", default=[1.0, 25.0])
    parser.add_argument("--repeats", type=int, default=4, help="saves+loads in a row per timing")
    parser.add_argument("--trials", type=int, default=3, help="timings per column (the median)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}")
    print(
        f"{'params':>8} {'MB':>6} | {'plain s':>8} | {'default s':>9} {'ratio':>6} | "
        f"{'durable s':>9} {'ratio':>6} | {'no-fsync s':>10} {'ratio':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.params_m:
            print(bench(n, args.device, args.repeats, args.trials, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
