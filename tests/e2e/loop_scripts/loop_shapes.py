"""Training loops of every common shape, checkpointed at every step and resumed in fresh processes.

    python loop_shapes.py drive        # a driver: reads jobs (JSON lines) on stdin, answers on stdout

Each job names a loop shape, ``num_workers``, the loader (``seeded``: ``torchrepro.SeededLoader``;
``plain``: a ``torch.utils.data.DataLoader(shuffle=True)`` resumed by skipping batches) and how a
checkpoint is resumed (``exact``, or one of the wrong ways the negative controls use). The driver
has imported torch once; for each job it forks one child for the uninterrupted run, which saves a
checkpoint with ``torchrepro.save_checkpoint`` at every point in the loop where users save (after
every optimizer step, inside the inner loop; with gradient accumulation after *every* backward,
mid-window included; after the epoch-end code where there is some), then forks one child per
checkpoint that resumes it and trains to the end. Every child is a new process that starts from
nothing but the checkpoint file: before each fork the driver reseeds Python, NumPy and torch with
other seeds, and the child builds the model, optimizer, scheduler and loaders anew, scrambles them
(random weights, stale gradients, an optimizer step, other epochs) and the global RNGs once more,
and only then calls ``load_checkpoint``, so anything the resume fails to restore shows. The driver
compares every resumed final state (parameters, gradients, optimizer, scheduler, loader positions,
the epoch-end history and the counters) with the uninterrupted one, ``torch.equal`` on every
tensor, and answers one JSON line per job: the checkpoints and, for each, the first differences.

Loop shapes (3 epochs of 3 batches, the last batch of each epoch partial; with ``num_workers=2``
the auto-advancing shapes keep their workers, ``persistent_workers=True``):

- ``auto``: ``for epoch in range(start, E): for batch in loader`` (the loader advances its epochs).
- ``set_epoch``: the same with ``loader.set_epoch(epoch)`` first (the usual distributed loop).
- ``after_loop``: ``set_epoch``, and code after the inner loop (validation through a second
  SeededLoader, shrink-and-perturb of the weights), then a checkpoint.
- ``for_else``: the inner loop breaks at a step budget; ``else:`` runs the epoch-end code and a
  checkpoint, then ``continue``; ``break`` (the nested-loop break idiom).
- ``sched_step``: ``set_epoch``, an LR scheduler stepped after every optimizer step.
- ``sched_epoch``: code after the inner loop with an LR scheduler stepped once per epoch.
- ``accum2``: ``set_epoch``, gradient accumulation over 2 batches (windows crossing epochs), SGD
  with momentum and a per-step scheduler; a checkpoint after every backward.

Resume modes: ``exact`` (``load_checkpoint`` of everything); the negative controls ``no_rng``
(``restore_rng=False``), ``fresh_loader`` (the loader's position is not restored; ``set_epoch``
starts the epoch from its first batch, as it did before issue 12), ``old_finished`` (a checkpoint at
an epoch's last batch resumes at the next epoch, as before issue 12) and ``drop_grads`` (gradients
are not restored, as before issue 12).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import torchrepro

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import forking

SEED = 1234
EPOCHS = 3
N_TRAIN, N_VAL, BATCH = 10, 8, 4  # 3 training batches per epoch (the last of 2), 2 validation
FOR_ELSE_MAX_STEPS = 8  # the for/else shape breaks out in the middle of its third epoch
CHILD_TIMEOUT_S = 120


@dataclass(frozen=True)
class Shape:
    set_epoch: bool  # loader.set_epoch(epoch) at the top of every epoch
    epoch_end: str  # "none", "after" (code after the inner loop) or "else" (for/else + break)
    scheduler: str  # "none", "step" (after every optimizer step) or "epoch" (after each epoch)
    accum: int = 1  # batches per optimizer step
    persistent: bool = False  # persistent_workers=True when num_workers > 0


SHAPES = {
    "auto": Shape(set_epoch=False, epoch_end="none", scheduler="none", persistent=True),
    "set_epoch": Shape(set_epoch=True, epoch_end="none", scheduler="none"),
    "after_loop": Shape(set_epoch=True, epoch_end="after", scheduler="none"),
    "for_else": Shape(set_epoch=False, epoch_end="else", scheduler="none", persistent=True),
    "sched_step": Shape(set_epoch=True, epoch_end="none", scheduler="step"),
    "sched_epoch": Shape(set_epoch=False, epoch_end="after", scheduler="epoch", persistent=True),
    "accum2": Shape(set_epoch=True, epoch_end="none", scheduler="step", accum=2),
}
LOADERS = ("seeded", "plain")
MODES = ("exact", "no_rng", "fresh_loader", "old_finished", "drop_grads")


@dataclass(frozen=True)
class Job:
    shape: str
    workers: int
    loader: str = "seeded"
    mode: str = "exact"

    def __post_init__(self) -> None:
        assert self.shape in SHAPES and self.loader in LOADERS and self.mode in MODES, self
        assert self.workers in (0, 2), self

    @property
    def name(self) -> str:
        return f"{self.shape}-w{self.workers}-{self.loader}-{self.mode}"


# ------------------------------------------------------------------------------------------
# Data and model.


class Augmented(Dataset[tuple[torch.Tensor, int]]):
    """Fixed features plus random augmentation from every RNG a dataset may use."""

    def __init__(self, n: int, *, offset: int, seeded: bool) -> None:
        generator = torch.Generator().manual_seed(offset)
        self.x = torch.randn(n, 8, generator=generator)
        self.offset = offset
        self.seeded = seeded

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.x[index] + 0.3 * torch.randn(8)  # torch's global RNG
        x = x * (0.9 + 0.2 * random.random()) + float(np.random.normal(scale=0.05))
        if self.seeded:
            x = x + float(torchrepro.sample_rng().uniform(-0.1, 0.1))
        return x, (index + self.offset) % 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.dropout = torch.nn.Dropout(0.25)  # draws from torch's RNG at every training step
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.dropout(torch.relu(self.hidden(x))))


# ------------------------------------------------------------------------------------------
# The training loop, as a user writes it.

# Called by the uninterrupted run at every save point: (label, objects, plain values).
Saver = Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], None]
# Called on a resume, after everything is built and before load_checkpoint.
Scrambler = Callable[[dict[str, Any]], None]


def train(job: Job, *, save: Saver | None, resume: Path | None, scramble: Scrambler | None) -> dict[str, Any]:
    """Run (or resume) the job's loop to the end; return the final state."""
    shape = SHAPES[job.shape]
    seeded = job.loader == "seeded"
    torchrepro.seed_everything(SEED)
    context: dict[str, Any] = {}
    if job.workers:
        context = {"multiprocessing_context": "fork", "persistent_workers": shape.persistent}
    train_data = Augmented(N_TRAIN, offset=0, seeded=seeded)
    loader: Any
    if seeded:
        loader = torchrepro.SeededLoader(train_data, batch_size=BATCH, num_workers=job.workers, **context)
    else:
        loader = DataLoader(train_data, batch_size=BATCH, shuffle=True, num_workers=job.workers, **context)
    val_loader = None
    if shape.epoch_end != "none":
        val_data = Augmented(N_VAL, offset=1, seeded=seeded)
        val_loader = torchrepro.SeededLoader(val_data, batch_size=BATCH, shuffle=False)  # in-process
    model = Net()
    optimizer: torch.optim.Optimizer
    if shape.accum > 1:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler: Any = None
    if shape.scheduler == "step":
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    elif shape.scheduler == "epoch":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    objects: dict[str, Any] = {"model": model, "optimizer": optimizer}
    if scheduler is not None:
        objects["scheduler"] = scheduler
    if seeded:
        objects["loader"] = loader
    if val_loader is not None:
        objects["val_loader"] = val_loader

    start_epoch, in_epoch, step, micro = 0, 0, 0, 0
    history: list[float] = []
    if resume is not None:
        if scramble is not None:
            scramble(objects)
        to_load = dict(objects)
        if job.mode == "fresh_loader":
            del to_load["loader"]
        values = torchrepro.load_checkpoint(resume, restore_rng=job.mode != "no_rng", **to_load)
        start_epoch, in_epoch, step, micro = (
            values["epoch"],
            values["in_epoch"],
            values["step"],
            values["micro"],
        )
        history = values["history"]
        if job.mode == "old_finished" and in_epoch == len(loader):
            loader.set_epoch(start_epoch + 1)  # the next pass is the next epoch, from its first batch
        if job.mode == "drop_grads":
            for p in model.parameters():
                p.grad = None

    def checkpoint(where: str, epoch: int) -> None:
        if save is not None:
            label = {"where": where, "epoch": epoch, "in_epoch": in_epoch, "step": step, "micro": micro}
            save(label, objects, {**label, "history": list(history)})

    def train_on(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        nonlocal step, micro
        x, y = batch
        if shape.accum == 1:
            optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y) / shape.accum
        loss.backward()
        micro += 1
        if micro % shape.accum == 0:
            optimizer.step()
            if shape.accum > 1:
                optimizer.zero_grad()
            if shape.scheduler == "step":
                scheduler.step()
            step += 1

    def end_of_epoch() -> None:
        assert val_loader is not None
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(x), y, reduction="sum") for x, y in val_loader]
        model.train()
        history.append(float(torch.stack(losses).sum()))
        with torch.no_grad():  # shrink and perturb
            for p in model.parameters():
                p.mul_(0.9).add_(torch.randn_like(p), alpha=1e-3)
        if shape.scheduler == "epoch":
            scheduler.step()

    batches: Any
    for epoch in range(start_epoch, EPOCHS):
        if shape.set_epoch:
            loader.set_epoch(epoch)
        batches = loader
        if not seeded:  # a plain DataLoader resumed the usual way: throw the first batches away
            batches = itertools.islice(loader, in_epoch if epoch == start_epoch else 0, None)
        if epoch != start_epoch:
            in_epoch = 0
        if shape.epoch_end == "else":
            for batch in batches:
                if step >= FOR_ELSE_MAX_STEPS:
                    break
                train_on(batch)
                in_epoch += 1
                checkpoint("inner", epoch)
            else:
                end_of_epoch()
                in_epoch = 0
                checkpoint("after", epoch + 1)
                continue
            break
        for batch in batches:
            train_on(batch)
            in_epoch += 1
            checkpoint("inner", epoch)  # after every backward: mid-window too with accumulation
        if shape.epoch_end == "after":
            end_of_epoch()
            in_epoch = 0
            checkpoint("after", epoch + 1)

    final: dict[str, Any] = {
        "model": model.state_dict(),
        "grads": {name: p.grad for name, p in model.named_parameters()},
        "optimizer": optimizer.state_dict(),
        "counters": {"step": step, "micro": micro, "history": history},
    }
    if scheduler is not None:
        final["scheduler"] = scheduler.state_dict()
    # Not the loaders' state dicts: equal positions may be spelled differently (a finished epoch,
    # or the start of the next one), and the batches they gave are in the weights already.
    return final


# ------------------------------------------------------------------------------------------
# Comparing final states.


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors bit for bit: dtype, shape and torch.equal)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return [f"{path}: tensors differ"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for key in a for d in differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} vs {b!r}"]


def digest(state: Any) -> str:
    """A digest of a final state (tensor bytes, dtypes, shapes and plain values)."""
    h = hashlib.sha256()

    def feed(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            h.update(f"T{obj.dtype}{tuple(obj.shape)}".encode())
            h.update(obj.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            h.update(b"{")
            for key in sorted(obj, key=repr):
                h.update(repr(key).encode())
                feed(obj[key])
            h.update(b"}")
        elif isinstance(obj, (list, tuple)):
            h.update(b"[")
            for item in obj:
                feed(item)
            h.update(b"]")
        else:
            h.update(repr(obj).encode())

    feed(state)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------
# The driver: one uninterrupted run and one resume per checkpoint, each in a forked child.


def scramble_globals(salt: int) -> None:
    """Reseed every global RNG with seeds no run uses."""
    random.seed(10_000 + salt)
    np.random.seed(10_000 + salt)
    torch.manual_seed(10_000 + salt)


def scramble_objects(objects: dict[str, Any]) -> None:
    """Put every object in a state a correct resume must overwrite, and the RNGs elsewhere."""
    scramble_globals(os.getpid())
    model, optimizer = objects["model"], objects["optimizer"]
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
            p.grad = torch.randn_like(p)  # stale gradients
    optimizer.step()  # optimizer state (moments, momentum buffers)
    if "scheduler" in objects:
        objects["scheduler"].step()
    for name, epoch in (("loader", 5), ("val_loader", 7)):
        if name in objects:
            objects[name].set_epoch(epoch)
    scramble_globals(os.getpid() + 1)


def in_child(work: Callable[[], None], log: Path) -> int:
    """Run ``work`` in a forked child (stdout and stderr to ``log``); its exit code."""

    def guarded() -> None:
        signal.alarm(CHILD_TIMEOUT_S)  # a hung child dies (SIGALRM) instead of hanging the test
        warnings.simplefilter("error")  # like the test suite's filterwarnings = error
        # ... less what tests/conftest.py ignores: the warning that 2 workers exceed this
        # machine's CPUs (on a 1-CPU machine), which says nothing about the resume
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        work()

    return forking.wait(forking.start(guarded, log=log))


def run_job(job: Job, directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    labels_file, full_file = directory / "checkpoints.json", directory / "full.pt"

    def uninterrupted() -> None:
        labels: list[dict[str, Any]] = []

        def save(label: dict[str, Any], objects: dict[str, Any], values: dict[str, Any]) -> None:
            path = directory / f"ckpt-{len(labels):03d}.pt"
            torchrepro.save_checkpoint(path, **objects, **values)
            labels.append({**label, "file": path.name})

        torch.save(train(job, save=save, resume=None, scramble=None), full_file)
        labels_file.write_text(json.dumps(labels))

    scramble_globals(0)
    code = in_child(uninterrupted, directory / "full.log")
    if code != 0:
        return {
            "job": job.name,
            "error": f"uninterrupted run failed ({code}):\n{(directory / 'full.log').read_text()}",
        }
    full = torch.load(full_file, weights_only=True)
    labels = json.loads(labels_file.read_text())
    results = []
    for i, label in enumerate(labels):
        out, log = directory / f"resumed-{i:03d}.pt", directory / f"resumed-{i:03d}.log"

        def resumed(ckpt: Path = directory / label["file"], out: Path = out) -> None:
            torch.save(train(job, save=None, resume=ckpt, scramble=scramble_objects), out)

        scramble_globals(i + 1)
        code = in_child(resumed, log)
        if code != 0:
            results.append({"error": f"exit {code}: {log.read_text()[-2000:]}", "differences": None})
            continue
        results.append(
            {"error": None, "differences": differences(full, torch.load(out, weights_only=True))[:5]}
        )
        out.unlink()
    return {
        "job": job.name,
        "error": None,
        "checkpoints": labels,
        "results": results,
        "digest": digest(full),
        "seconds": round(time.perf_counter() - started, 2),
    }


def warm_up() -> None:
    """Import once, here, what every child would otherwise import again (the first optimizer step
    pulls in torch._dynamo: seconds of CPU)."""
    model = Net()
    for optimizer in (
        torch.optim.Adam(model.parameters()),
        torch.optim.SGD(model.parameters(), momentum=0.9),
    ):
        model(torch.zeros(1, 8)).sum().backward()
        optimizer.step()


def drive() -> None:
    """Answer each job line on stdin with one result line on stdout."""
    torch.set_num_threads(1)  # one core per driver; forked children never meet an OpenMP pool
    warm_up()
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = run_job(Job(**request["job"]), Path(request["dir"]))
        except Exception:
            result = {"job": request["job"], "error": traceback.format_exc()}
        protocol.write(json.dumps(result) + "\n")
        protocol.flush()


if __name__ == "__main__":
    assert sys.argv[1:] == ["drive"], __doc__
    drive()
