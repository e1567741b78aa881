"""A 2-rank data-parallel training loop written by hand (gradients all-reduced, an SGD update) that
leaves a gzip log and a zip archive open until the process ends.

Ranks from ``torchrun`` (``RANK`` set), or started by the script itself with
``python open_files.py --spawn PORT`` (``torch.multiprocessing.spawn``). Only ``close()`` writes a
gzip trailer and a zip central directory: the interpreter's exit closes them, as it does for every
file still open in a module's globals.

``--late``: rank 0 ends the way that makes torch's gloo abort at exit in most runs. Inside
``backward()`` a hook starts an ``all_reduce`` and drops its handle, so the gloo worker thread holds
the last reference to a work that captured the autograd context; rank 1 joins it 1 s later, while
rank 0's main thread holds the GIL (a busy loop, a long switch interval) for 3 s, then exits: the
worker, done with the collective, waits for the GIL to destroy the work when the interpreter's
finalization starts; once the finalization lets the GIL go, the worker takes it and ``take_gil``
ends it inside a ``noexcept`` destructor (SIGABRT, "terminate called without an active
exception"): plain launchers abort in most such runs (``benchmarks/exit_aborts.py`` counts them).
With ``LATE_REPORT=1`` rank 0 prints whether the worker's decref of the autograd context was still
pending at the script's end.
"""

import gzip
import os
import sys
import time
import zipfile

import torch
import torch.distributed as dist

STEPS = 3


def main(rank=None, port=None):
    if rank is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rank = dist.get_rank()
    global log, archive
    log = gzip.open(f"log.rank{rank}.gz", "wt")  # noqa: SIM115 (left open: the point)
    archive = zipfile.ZipFile(f"archive.rank{rank}.zip", "w")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    for step in range(STEPS):
        loss = model(torch.full((2, 4), float(step + rank))).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p -= 0.05 * p.grad
                p.grad = None
        log.write(f"step {step} loss {loss.item():.6f}\n")
        archive.writestr(f"step{step}.txt", f"{loss.item():.6f}")
    if "--late" in sys.argv:
        late(rank)


def late(rank):
    if rank == 1:
        time.sleep(1)
        dist.all_reduce(torch.ones(3))
        time.sleep(3)
        return
    contexts = []

    def hook(grad):
        contexts.append(torch._C._get_obj_in_tls("context"))  # the autograd context the work copies
        dist.all_reduce(grad.clone(), async_op=True)  # its handle dropped at once

    w = torch.ones(3, requires_grad=True)
    w.register_hook(hook)
    (w * 2).sum().backward()
    sys.setswitchinterval(100)
    end = time.monotonic() + 3
    while time.monotonic() < end:  # rank 1 joins meanwhile: the worker waits for the GIL
        pass
    if os.environ.get("LATE_REPORT"):  # the write lets the GIL go: not in the plain launches
        pending = sys.getrefcount(contexts[0]) > 2  # the list's, the call's, the worker's
        print(f"late: a decref was pending at the script's end: {pending}", flush=True)


if __name__ == "__main__":
    if "--spawn" in sys.argv:
        import torch.multiprocessing as mp

        mp.spawn(main, args=(int(sys.argv[sys.argv.index("--spawn") + 1]),), nprocs=2)
    else:
        main()
