"""Section ``integration``: the library's parts on a GPU, end to end (item 5 of the GPU issue).

Rows (``check`` names; ``cuda`` in a name is the claim, the row's ``data["device"]`` says where it
ran):

- ``seeded_loader_pin_memory``: a ``SeededLoader`` with ``num_workers=2`` and ``pin_memory=True``
  over a dataset that draws from Python's, NumPy's and torch's global RNGs yields pinned batches
  that, after ``.to(device, non_blocking=True)``, are bitwise those of ``num_workers=0`` without
  pinning, for two epochs, and again from a new loader with the same seed.
  ``plain_loader_workers`` (info, the negative control): a plain ``DataLoader`` over the same
  dataset gives other batches with 2 workers than with none.
- ``rng_state_cuda``: ``RngState`` captures and restores the CUDA generator (``rand``, dropout,
  ``randn``, and a ``torch.Generator`` on the device passed by name), also through
  ``torch.save`` + ``torch.load(weights_only=True)``; without the restore the draws differ.
  ``fork_rng_cuda``: ``fork_rng`` leaves the streams as if the block had not run, and
  ``fork_rng(5)`` starts two blocks from the same streams (``fork_rng(6)`` does not).
- ``checkpoint_resume_cuda``: process A trains a model with dropout on the device, saves at step
  k and trains on to N; process B loads step k and trains on to N: the same parameter bits.
  The negative control (``restore_rng=False``) differs; the file loads with
  ``torch.load(weights_only=True)`` and holds the CUDA generator's state.
- ``check_reproducible``: ``python -m torchrepro check --json`` on a small training script (a
  ``SeededLoader`` with workers and pinning, dropout) exits 0, reproducible.
- ``check_divergence``: the same script with noise drawn from a device generator seeded from the
  clock at step 2: exit 1, the first divergence at step 2 naming the differing tensor.
- ``locate_cuda_op``: that divergence is located at the draw (op, module, ``train.py:<line>``).
- ``run_record_compare``: two ``python -m torchrepro run --record`` runs of the good script and
  ``compare --json``: equal.
- ``run_record_env_gpu``: the run record's ``env.json`` names the GPU (as torch names it), the
  driver, CUDA and cuDNN versions.
- ``audit_on_device``: ``torchrepro audit`` of a script run on the device finds grid_sample's
  backward (on CUDA cuDNN's sampler, which strict mode does not stop), scatter(reduce='multiply'),
  a generator seeded from the clock, and a switch set only on CUDA (as run there; as a branch not
  taken on the CPU).
- ``invariant_data_parallel``: InvariantDataParallel on the device gives the same bits in two fresh
  processes and on 2 processes (torchrun, gloo, both ranks on the one device).
- ``invariant_data_parallel_nccl``: and on 2 processes over NCCL, a GPU each (skipped, with the
  reason, on fewer than 2 CUDA devices).
- ``invariant_fsdp_cuda``: InvariantDataParallel over FSDP2 with ``clip_grad_norm_`` on the device
  (a process group of one over NCCL) ends with the unsharded run's bits (CUDA only).

Invariants:
- Everything runs in fresh child processes (``common.run_python`` or ``python -m torchrepro``):
  ``run`` imports no torch and changes nothing in its own process (environment, RNG, switches).
- Every child has at most ``CHILD_TIMEOUT`` seconds; a child that fails or times out makes its
  rows ``error`` with the tail of its output, never ``pass``.
- With ``ctx.device == "cpu"`` every check runs its CPU equivalent (the same code on the CPU:
  no pinning, the CPU generator); a row whose claim only exists on CUDA is ``skip`` and its
  detail names CUDA.
- A claim passes only when its negative control shows the check could have failed (the draws
  really are random, the streams really moved, the clock-seeded run really parts).
- The checks run side by side in a small thread pool (each waits on its own children); the rows
  come back in the order of ``CHECKS``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_checks.common import ChildResult, Context, Row, child_env, run_python

NAME = "integration"

CHILD_TIMEOUT = 120.0
"""Seconds any one child process (a script, a ``torchrepro`` command, pytest) may take."""


NOISE_MARKER = "# noise draw"
"""Ends the line of ``TRAIN_SCRIPT`` whose op the locate must name."""


def _row(check: str, status: str, detail: str, **data: Any) -> Row:
    return Row(section=NAME, check=check, status=status, detail=detail, data=data)


def _code(body: str, **params: Any) -> str:
    """A child script: ``params`` (plain values) as the dict ``P``, then ``body``.

    Different parameters make a different script, so ``run_python`` gives each its own file.
    """
    return f"P = {params!r}\n{body}"


def _child_failed(check: str, res: ChildResult) -> Row | None:
    if res.returncode == 0 and isinstance(res.result, dict):
        return None
    return _row(check, "error", f"child exited {res.returncode}: {res.tail()}")


def _steps(ctx: Context) -> int:
    return 4 if ctx.quick else 6


# --------------------------------------------------------------------------------------------
# 1. SeededLoader: workers + pin_memory + non_blocking copies equal the plain main-process load

LOADER_CHILD = """
import json
import random
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import torchrepro


class Augmented(Dataset):
    \"\"\"Sample i: [i, one draw from Python's, NumPy's and torch's global RNG each].\"\"\"

    def __len__(self):
        return P["samples"]

    def __getitem__(self, index):
        draws = [random.random(), float(np.random.rand()), *torch.rand(3).tolist()]
        return torch.tensor([float(index), *draws], dtype=torch.float64)


def load(loader, device, epochs, pinned):
    out = []
    for epoch in range(epochs):
        if epochs > 1:
            loader.set_epoch(epoch)
        for batch in loader:
            if device.type == "cuda":
                pinned.append(batch.is_pinned())
            out.append(batch.to(device, non_blocking=True))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def plain(dataset, device, workers):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    loader = DataLoader(dataset, batch_size=P["batch"], num_workers=workers)
    return load(loader, device, 1, [])


def main():
    # On a machine without an accelerator pin_memory=True is a no-op that warns.
    warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true")
    device = torch.device(P["device"])
    dataset = Augmented()
    kwargs = dict(batch_size=P["batch"], seed=3)
    pinned = []
    pinning = dict(num_workers=2, pin_memory=True)
    workers = load(torchrepro.SeededLoader(dataset, **pinning, **kwargs), device, 2, pinned)
    main_process = load(torchrepro.SeededLoader(dataset, num_workers=0, **kwargs), device, 2, [])
    again = load(torchrepro.SeededLoader(dataset, **pinning, **kwargs), device, 2, [])
    half = len(workers) // 2
    print(json.dumps({
        "batches": len(workers),
        "on_device": all(b.device.type == device.type for b in workers),
        "pinned": len(pinned) > 0 and all(pinned) if device.type == "cuda" else None,
        "equal_workers_vs_main": same(workers, main_process),
        "equal_two_passes": same(workers, again),
        "epochs_differ": not same(workers[:half], workers[half:]),
        "plain_differs": not same(plain(dataset, device, 0), plain(dataset, device, 2)),
    }))


if __name__ == "__main__":
    main()
"""


def check_loader(ctx: Context) -> list[Row]:
    check = "seeded_loader_pin_memory"
    res = run_python(
        _code(LOADER_CHILD, device=ctx.device, samples=24 if ctx.quick else 64, batch=4),
        cwd=ctx.workdir,
        timeout=CHILD_TIMEOUT,
    )
    failed = _child_failed(check, res)
    if failed:
        return [failed]
    r = dict(res.result)
    r["device"] = ctx.device
    ok = r["equal_workers_vs_main"] and r["equal_two_passes"] and r["epochs_differ"] and r["on_device"]
    if ctx.cuda:
        ok = ok and r["pinned"] is True
        where = "pinned batches (is_pinned) copied with non_blocking=True"
    else:
        where = "CPU equivalent: the batches stay on the CPU, is_pinned not checked"
    detail = (
        f"SeededLoader num_workers=2 pin_memory=True vs num_workers=0, 2 epochs, {r['batches']} batches: "
        f"equal {r['equal_workers_vs_main']}, a second loader equal {r['equal_two_passes']}, "
        f"epochs differ {r['epochs_differ']}; {where}"
    )
    control = "plain DataLoader, same random dataset and seed: num_workers=0 vs 2 " + (
        "differ (as expected)" if r["plain_differs"] else "are EQUAL: the dataset's draws did not count"
    )
    return [
        _row(check, "pass" if ok else "fail", detail, **r),
        _row("plain_loader_workers", "info", control, device=ctx.device, differs=r["plain_differs"]),
    ]


# --------------------------------------------------------------------------------------------
# 2. RngState and fork_rng: the CUDA generator (global and a device Generator object)

RNG_CHILD = """
import io
import json

import torch
import torch.nn.functional as F

from torchrepro import RngState, fork_rng


def main():
    device = torch.device(P["device"])
    torch.manual_seed(0)
    torch.rand(1, device=device)  # start CUDA first: RngState captures the devices already started
    gen = torch.Generator(device=device).manual_seed(1)
    named = {"noise": gen}

    def draws():
        return [
            torch.rand(64, device=device),
            F.dropout(torch.ones(256, device=device), 0.5, training=True),
            torch.randn(64, device=device),
            torch.randn(64, device=device, generator=gen),
        ]

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    state = RngState.capture(generators=named)
    first = draws()
    state.restore(generators=named)
    restored = same(first, draws())
    unrestored_differs = not same(first, draws())  # the streams moved on
    buffer = io.BytesIO()
    torch.save(state.to_dict(), buffer)
    buffer.seek(0)
    RngState.from_dict(torch.load(buffer, weights_only=True)).restore(generators=named)
    saved_loaded = same(first, draws())

    before = RngState.capture(generators=named)
    with fork_rng(generators=named):
        draws()
    after_block = draws()
    before.restore(generators=named)
    without_block = draws()
    before.restore(generators=named)
    draws()  # the same block without fork_rng: it moves the streams
    after_unforked = draws()
    with fork_rng(5):
        seeded_a = draws()[:3]
    with fork_rng(5):
        seeded_b = draws()[:3]
    with fork_rng(6):
        seeded_c = draws()[:3]
    print(json.dumps({
        "cuda_devices_captured": sorted(state.cuda),
        "restored_equal": restored,
        "unrestored_differs": unrestored_differs,
        "saved_loaded_equal": saved_loaded,
        "fork_block_isolated": same(after_block, without_block),
        "unforked_block_moves": not same(after_unforked, without_block),
        "fork_seed_equal": same(seeded_a, seeded_b),
        "fork_other_seed_differs": not same(seeded_a, seeded_c),
    }))


if __name__ == "__main__":
    main()
"""


FORK_KEYS = (
    "device",
    "fork_block_isolated",
    "unforked_block_moves",
    "fork_seed_equal",
    "fork_other_seed_differs",
)


def check_rng(ctx: Context) -> list[Row]:
    res = run_python(_code(RNG_CHILD, device=ctx.device), cwd=ctx.workdir, timeout=CHILD_TIMEOUT)
    failed = _child_failed("rng_state_cuda", res)
    if failed:
        return [failed, _row("fork_rng_cuda", "error", "see rng_state_cuda: the child failed")]
    r = dict(res.result)
    r["device"] = ctx.device
    captured = r["cuda_devices_captured"]
    devices_ok = 0 in captured if ctx.cuda else captured == []
    state_ok = r["restored_equal"] and r["saved_loaded_equal"] and r["unrestored_differs"] and devices_ok
    what = "torch.rand, dropout, randn and a torch.Generator on the device"
    state_detail = (
        f"{what} ({ctx.device}): restored equal {r['restored_equal']}, via torch.save/"
        f"load(weights_only=True) equal {r['saved_loaded_equal']}, without restore differ "
        f"{r['unrestored_differs']}; CUDA devices captured {captured}"
    )
    fork_ok = (
        r["fork_block_isolated"]
        and r["unforked_block_moves"]
        and r["fork_seed_equal"]
        and r["fork_other_seed_differs"]
    )
    fork_detail = (
        f"fork_rng ({ctx.device}): streams after the block as without it {r['fork_block_isolated']} "
        f"(without fork_rng they move: {r['unforked_block_moves']}); fork_rng(5) twice equal "
        f"{r['fork_seed_equal']}, fork_rng(6) differs {r['fork_other_seed_differs']}"
    )
    return [
        _row("rng_state_cuda", "pass" if state_ok else "fail", state_detail, **r),
        _row("fork_rng_cuda", "pass" if fork_ok else "fail", fork_detail, **{k: r[k] for k in FORK_KEYS}),
    ]


# --------------------------------------------------------------------------------------------
# 3. Checkpoints: resume in a fresh process restores the CUDA generator

CHECKPOINT_CHILD = """
import json

import torch
import torch.nn.functional as F
from torch import nn

import torchrepro


def main():
    device = torch.device(P["device"])
    torchrepro.seed_everything(0)
    torchrepro.set_determinism("strict")
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start, found = 0, {}
    if P["mode"] != "full":
        torch.manual_seed(1234)  # other streams (CPU and every CUDA device) unless the load restores them
        restore_rng = P["mode"] == "resume"
        values = torchrepro.load_checkpoint(P["path"], model=model, optimizer=opt, restore_rng=restore_rng)
        start = values["step"]
        raw = torch.load(P["path"], weights_only=True)
        found = {"weights_only_keys": sorted(raw), "cuda_rng_devices": sorted(raw["rng"]["state"]["cuda"])}
    for step in range(start, P["steps"]):
        x = torch.randn(32, 16, device=device)  # data, dropout masks: all from the device's generator
        y = torch.randint(0, 4, (32,), device=device)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if P["mode"] == "full" and step + 1 == P["save_at"]:
            torchrepro.save_checkpoint(P["path"], model=model, optimizer=opt, step=step + 1)
    print(json.dumps({"fingerprint": torchrepro.fingerprint(model), "start": start, **found}))


if __name__ == "__main__":
    main()
"""


def check_checkpoint(ctx: Context) -> list[Row]:
    check = "checkpoint_resume_cuda"
    folder = ctx.workdir / "checkpoint"
    folder.mkdir(parents=True, exist_ok=True)
    steps = _steps(ctx)
    params = {"device": ctx.device, "path": str(folder / "step.pt"), "steps": steps, "save_at": steps // 2}
    out: dict[str, dict[str, Any]] = {}
    for mode in ("full", "resume", "no_rng"):  # A saves the file that B and C load
        res = run_python(_code(CHECKPOINT_CHILD, mode=mode, **params), cwd=ctx.workdir, timeout=CHILD_TIMEOUT)
        failed = _child_failed(check, res)
        if failed:
            failed.detail = f"process {mode!r}: {failed.detail}"
            return [failed]
        out[mode] = res.result
    resume, no_rng = out["resume"], out["no_rng"]
    resumed_equal = resume["fingerprint"] == out["full"]["fingerprint"]
    control_differs = no_rng["fingerprint"] != out["full"]["fingerprint"]
    cuda_rng = resume["cuda_rng_devices"]
    cuda_ok = "0" in cuda_rng if ctx.cuda else cuda_rng == []
    ok = resumed_equal and control_differs and cuda_ok and resume["start"] == params["save_at"]
    detail = (
        f"A trains {steps} steps ({ctx.device}, dropout) saving at {params['save_at']}; B loads it in a "
        f"new process and trains on: equal {resumed_equal}; restore_rng=False differs {control_differs}; "
        f"torch.load(weights_only=True) reads it; CUDA generator states in the file: {cuda_rng}"
    )
    data = {
        "device": ctx.device,
        "steps": steps,
        "save_at": params["save_at"],
        "fingerprints": {mode: r["fingerprint"] for mode, r in out.items()},
        "resumed_equal": resumed_equal,
        "no_rng_differs": control_differs,
        "weights_only_keys": resume["weights_only_keys"],
        "cuda_rng_devices": cuda_rng,
    }
    return [_row(check, "pass" if ok else "fail", detail, **data)]


# --------------------------------------------------------------------------------------------
# 4-6. The command line on a training script: check, check of a broken variant and its locate,
# run --record twice and compare

TRAIN_SCRIPT = f'''"""A small training run for the integration checks: a SeededLoader with two
workers (pinned on CUDA), an MLP with dropout, SGD with momentum. --broken adds noise from a
device generator seeded from the clock at step 2, so two runs part there, at the draw."""

import argparse
import time

import torch
from torch import nn

import torchrepro


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.randn(16) + float(torchrepro.sample_rng().normal()), index % 4


class Noise(nn.Module):
    def __init__(self):
        super().__init__()
        self.gen = None  # set at step 2 by --broken

    def forward(self, h):
        if self.gen is None:
            return h
        return h + 0.1 * torch.randn(h.shape, device=h.device, generator=self.gen)  {NOISE_MARKER}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.noise = Noise()
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(self.noise(torch.relu(self.fc1(x)))))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--broken", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torchrepro.SeededLoader(Samples(), batch_size=8, num_workers=2, pin_memory=device.type == "cuda")
    for step, (x, y) in zip(range(args.steps), loader):
        if args.broken and step == 2:
            model.noise.gen = torch.Generator(device=device).manual_seed(time.time_ns())
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


if __name__ == "__main__":
    main()
'''


def _noise_line() -> int:
    return next(n for n, line in enumerate(TRAIN_SCRIPT.splitlines(), 1) if line.endswith(NOISE_MARKER))


def _script_dir(ctx: Context, name: str) -> Path:
    folder = ctx.workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(TRAIN_SCRIPT, encoding="utf-8")
    return folder


def _torchrepro(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchrepro", *args],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )


def _verdict(proc: subprocess.CompletedProcess[str]) -> dict[str, Any] | None:
    lines = proc.stdout.strip().splitlines()
    try:
        verdict = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return verdict if isinstance(verdict, dict) else None


def _failed_command(check: str, what: str, proc: subprocess.CompletedProcess[str]) -> Row:
    tail = (proc.stderr.strip() or proc.stdout.strip())[-600:]
    return _row(check, "error", f"{what} exited {proc.returncode} without a JSON verdict: {tail}")


def _script_args(ctx: Context, *extra: str) -> list[str]:
    return ["train.py", "--device", ctx.device, "--steps", str(_steps(ctx)), *extra]


def check_reproducible(ctx: Context) -> list[Row]:
    check = "check_reproducible"
    proc = _torchrepro(_script_dir(ctx, "check_good"), "check", "--json", *_script_args(ctx))
    verdict = _verdict(proc)
    if verdict is None:
        return [_failed_command(check, "torchrepro check", proc)]
    kinds = verdict.get("coverage", {}).get("per_kind", {})
    ok = (
        proc.returncode == 0
        and verdict.get("reproducible") is True
        and kinds.get("compute", 0) >= _steps(ctx)
    )
    detail = (
        f"python -m torchrepro check --json train.py --device {ctx.device}: exit {proc.returncode}, "
        f"reproducible {verdict.get('reproducible')}, {verdict.get('steps_compared')} steps compared, "
        f"events {kinds}"
    )
    data = {
        "device": ctx.device,
        "returncode": proc.returncode,
        **{k: verdict.get(k) for k in ("reproducible", "steps_compared", "coverage", "notes")},
    }
    return [_row(check, "pass" if ok else "fail", detail, **data)]


def check_broken(ctx: Context) -> list[Row]:
    proc = _torchrepro(_script_dir(ctx, "check_broken"), "check", "--json", *_script_args(ctx, "--broken"))
    verdict = _verdict(proc)
    if verdict is None:
        failed = _failed_command("check_divergence", "torchrepro check (broken script)", proc)
        return [failed, _row("locate_cuda_op", "error", "see check_divergence: the check failed")]
    first = verdict.get("first_divergence") or {}
    base = {"device": ctx.device, "returncode": proc.returncode, "first_divergence": first}
    parted = (
        proc.returncode == 1
        and verdict.get("reproducible") is False
        and (first.get("step"), first.get("kind")) == (2, "compute")
        and bool(first.get("name"))
    )
    divergence = _row(
        "check_divergence",
        "pass" if parted else "fail",
        f"noise from a clock-seeded {ctx.device} generator at step 2: exit {proc.returncode}, first "
        f"divergence step {first.get('step')} ({first.get('kind')}), tensor {first.get('name')}",
        **base,
    )
    expected = f"train.py:{_noise_line()}"
    op = first.get("op") or ""
    located = parted and ("randn" in op or "normal" in op) and first.get("module") == "noise"
    located = located and first.get("location") == expected
    locate = _row(
        "locate_cuda_op",
        "pass" if located else "fail",
        f"located at op {first.get('op')}, module {first.get('module')}, {first.get('location')} "
        f"(expected a randn op in module noise at {expected})",
        **base,
        expected_location=expected,
        notes=verdict.get("notes"),
    )
    return [divergence, locate]


ENV_KEYS = ("gpus", "gpu_driver", "cuda_version", "cudnn_version", "nccl_version", "cuda_initialized")

DEVICE_NAMES_CHILD = """
import json

import torch

print(json.dumps({"names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
"""


def check_run_record(ctx: Context) -> list[Row]:
    folder = _script_dir(ctx, "run_record")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two runs side by side
        records = [
            pool.submit(_torchrepro, folder, "run", "--record", rec, *_script_args(ctx)) for rec in "ab"
        ]
        runs = [record.result() for record in records]
    bad = next((p for p in runs if p.returncode != 0), None)
    if bad is not None:
        tail = (bad.stderr.strip() or bad.stdout.strip())[-600:]
        return [
            _row("run_record_compare", "error", f"torchrepro run --record exited {bad.returncode}: {tail}"),
            _row("run_record_env_gpu", "error", "see run_record_compare: a run failed"),
        ]
    proc = _torchrepro(folder, "compare", "--json", "a", "b")
    verdict = _verdict(proc)
    if verdict is None:
        compare = _failed_command("run_record_compare", "torchrepro compare", proc)
    else:
        equal = proc.returncode == 0 and verdict.get("reproducible") is True
        compare = _row(
            "run_record_compare",
            "pass" if equal else "fail",
            f"run --record a, run --record b ({ctx.device}), compare --json a b: exit {proc.returncode}, "
            f"reproducible {verdict.get('reproducible')}, {verdict.get('steps_compared')} steps compared",
            device=ctx.device,
            returncode=proc.returncode,
            **{k: verdict.get(k) for k in ("reproducible", "steps_compared", "first_divergence", "notes")},
        )
    return [compare, _env_row(ctx, folder / "a" / "env.json")]


def _env_row(ctx: Context, path: Path) -> Row:
    check = "run_record_env_gpu"
    env = json.loads(path.read_text(encoding="utf-8"))
    held = {k: env.get(k) for k in ENV_KEYS}
    if not ctx.cuda:
        return _row(check, "skip", "needs CUDA: a CPU run's environment has no GPU to name", env=held)
    res = run_python(DEVICE_NAMES_CHILD, cwd=ctx.workdir, timeout=CHILD_TIMEOUT)
    failed = _child_failed(check, res)
    if failed:
        return failed
    torch_names: list[str] = res.result["names"]
    recorded = [g.get("name") or "" for g in env.get("gpus") or []]
    # nvidia-smi and torch may word a name differently (a MIG slice): one must begin the other
    names_match = bool(recorded) and len(recorded) == len(torch_names)
    names_match = names_match and all(
        a and (a.startswith(b) or b.startswith(a)) for a, b in zip(recorded, torch_names, strict=True)
    )
    missing = [k for k in ("gpu_driver", "cuda_version", "cudnn_version") if not env.get(k)]
    ok = names_match and not missing
    detail = f"env.json names GPUs {recorded} (torch: {torch_names}), driver {env.get('gpu_driver')}, "
    detail += f"CUDA {env.get('cuda_version')}, cuDNN {env.get('cudnn_version')}"
    if missing:
        detail += f"; missing: {missing}"
    return _row(check, "pass" if ok else "fail", detail, env=held, torch_names=torch_names)


# --------------------------------------------------------------------------------------------
# 7. InvariantDataParallel (issue 22)

IDP_CHILD = """
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
import torch.distributed as dist
from torch import nn

import torchrepro

device = P["device"]
if "RANK" in os.environ:
    # gloo: every rank on the one device, gradients through the CPU; nccl: a device per rank
    dist.init_process_group(P.get("backend", "gloo"))
    if P.get("backend") == "nccl":
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
torchrepro.set_determinism("strict")
torch.set_num_threads(1)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 8, 8, generator=g) + 0.1 * torch.randn(3, 8, 8), i % 4


torch.manual_seed(0)
layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3), nn.Flatten()]
net = nn.Sequential(*layers, nn.Linear(512, 4)).to(device)
loader = torchrepro.SeededLoader(Data(), batch_size=2, global_batch_size=24, seed=0)
model = torchrepro.InvariantDataParallel(net, loader)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(2):
    loader.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        if (i + 1) % loader.accumulation_steps == 0:
            opt.step()
            opt.zero_grad()
fp = torchrepro.fingerprint({"model": net.state_dict(), "opt": opt.state_dict()["state"]})
out = [fp]
if dist.is_initialized():
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, fp)
    dist.barrier()
if not dist.is_initialized() or dist.get_rank() == 0:
    print(json.dumps({"fingerprints": out, "device": str(next(net.parameters()).device)}))
sys.stdout.flush()
os._exit(0)  # plain torchrun: torch's gloo worker may abort a rank at exit (pytorch#190489); printed
"""


def check_invariant_data_parallel(ctx: Context) -> list[Row]:
    """A CNN with BatchNorm and dropout trained by InvariantDataParallel on the device, strict
    mode: two fresh single processes and a 2-process torchrun (gloo, both ranks on the device)
    must end with the same weights and optimizer state."""
    check = "invariant_data_parallel"
    code = _code(IDP_CHILD, device=ctx.device)
    runs = {}
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    for name, prefix in (("1 process", ()), ("1 process again", ()), ("2 processes", torchrun)):
        res = run_python(code, cwd=ctx.workdir / "idp", argv_prefix=prefix, timeout=CHILD_TIMEOUT * 2)
        failed = _child_failed(check, res)
        if failed:
            return [failed]
        runs[name] = res.result["fingerprints"]
    every = {fp for fps in runs.values() for fp in fps}
    ok = len(every) == 1 and len(runs["2 processes"]) == 2
    detail = (
        f"InvariantDataParallel on {ctx.device} (strict): "
        + ", ".join(f"{name} {'/'.join(fp[:8] for fp in fps)}" for name, fps in runs.items())
        + ("; the same bits" if ok else "; the bits differ")
    )
    row = _row(check, "pass" if ok else "fail", detail, fingerprints=runs)
    return [row, _idp_nccl(ctx, runs["1 process"])]


DEVICE_COUNT = "import json, torch\nprint(json.dumps({'devices': torch.cuda.device_count()}))\n"


def _idp_nccl(ctx: Context, single: list[str]) -> Row:
    """``invariant_data_parallel_nccl``: the same training on 2 processes over NCCL (a GPU each;
    the reduction's all-to-alls on the devices) ends with the bits of 1 process."""
    check = "invariant_data_parallel_nccl"
    if not ctx.cuda:
        return _row(check, "skip", "NCCL runs on CUDA only: InvariantDataParallel over NCCL needs 2 devices")
    count = run_python(DEVICE_COUNT, cwd=ctx.workdir / "idp-nccl", timeout=CHILD_TIMEOUT)
    failed = _child_failed(check, count)
    if failed:
        return failed
    devices = int(count.result["devices"])
    if devices < 2:
        return _row(check, "skip", f"NCCL needs a CUDA device per rank; {devices} visible, 2 needed")
    code = _code(IDP_CHILD, device=ctx.device, backend="nccl")
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    res = run_python(code, cwd=ctx.workdir / "idp-nccl", argv_prefix=torchrun, timeout=CHILD_TIMEOUT * 2)
    failed = _child_failed(check, res)
    if failed:
        return failed
    fps = res.result["fingerprints"]
    ok = len(fps) == 2 and set(fps) == set(single)
    detail = (
        f"InvariantDataParallel on 2 processes over NCCL (cuda:0, cuda:1): {'/'.join(fp[:8] for fp in fps)} "
        f"against 1 process {single[0][:8]}" + ("; the same bits" if ok else "; the bits differ")
    )
    return _row(check, "pass" if ok else "fail", detail, fingerprints=fps, single=single)


FSDP_CHILD = """
import json
import os
import socket
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import torchrepro

device = P["device"]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
torchrepro.set_determinism("strict")
torch.set_num_threads(1)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g) + 0.1 * torch.randn(16), i % 4


def train(sharded):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Dropout(0.2)) for _ in range(2)]
    net = nn.Sequential(*blocks, nn.Linear(16, 4)).to(device)
    if sharded:
        for block in blocks:
            fully_shard(block)
        fully_shard(net)
    loader = torchrepro.SeededLoader(Data(), batch_size=2, global_batch_size=8, seed=0)
    model = torchrepro.InvariantDataParallel(net, loader)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    norms = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            if (i + 1) % loader.accumulation_steps == 0:
                norms.append(float(torchrepro.clip_grad_norm_(model.parameters(), 0.1)).hex())
                opt.step()
                opt.zero_grad()
    whole = {n: p.detach() for n, p in net.named_parameters()}
    whole = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in whole.items()}
    return torchrepro.fingerprint(whole), norms


plain, sharded = train(False), train(True)
print(json.dumps({"plain": plain, "sharded": sharded, "device": device}))
sys.stdout.flush()
dist.destroy_process_group()
"""


def check_invariant_fsdp(ctx: Context) -> list[Row]:
    """``invariant_fsdp_cuda``: InvariantDataParallel over FSDP2 on the device (a process group of
    one, NCCL: the reduce-scatter and post-reduce hook run on FSDP2's own streams) ends with the
    unsharded run's weights and clipping norms, in strict mode."""
    check = "invariant_fsdp_cuda"
    if not ctx.cuda:
        return [_row(check, "skip", "FSDP2's reduction streams exist on CUDA only (the tests run the CPU)")]
    res = run_python(_code(FSDP_CHILD, device=ctx.device), cwd=ctx.workdir / "fsdp", timeout=CHILD_TIMEOUT)
    failed = _child_failed(check, res)
    if failed:
        return [failed]
    plain, sharded = res.result["plain"], res.result["sharded"]
    ok = plain == sharded
    detail = (
        f"InvariantDataParallel over FSDP2 on {ctx.device}: weights {sharded[0][:8]} against unsharded "
        f"{plain[0][:8]}, clipping norms {'equal' if plain[1] == sharded[1] else 'differ'}"
        + ("; the same bits" if ok else "; the bits differ")
    )
    return [_row(check, "pass" if ok else "fail", detail, plain=plain, sharded=sharded)]


AUDIT_SCRIPT = """
import time, sys, warnings
import torch
import torch.nn.functional as F

device = sys.argv[1]
torch.manual_seed(0)
torch.set_num_threads(1)
if torch.cuda.is_available():
    torch.backends.cudnn.benchmark = True  # switch-on-cuda
noise = torch.Generator(device=device).manual_seed(time.time_ns())  # clock-seed
net = torch.nn.Conv2d(1, 2, 3, padding=1).to(device)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x = torch.randn(2, 1, 8, 8, device=device, requires_grad=True)
grid = torch.rand(2, 6, 6, 2, device=device, generator=noise) * 2 - 1
out = F.grid_sample(net(x), grid, align_corners=True)  # grid-sample
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    weights = torch.ones(4, device=device).scatter_(  # scatter-multiply
        0, torch.tensor([0, 0, 1, 1], device=device), torch.full((4,), 2.0, device=device), reduce="multiply"
    )
out.sum().backward()
opt.step()
"""


def _audit_line(marker: str) -> str:
    number = next(n for n, line in enumerate(AUDIT_SCRIPT.splitlines(), 1) if line.endswith(f"# {marker}"))
    return f"audited.py:{number}"


def check_audit(ctx: Context) -> list[Row]:
    """``torchrepro audit`` of a script that runs on the device: what it finds there."""
    check = "audit_on_device"
    folder = ctx.workdir / "audit"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "audited.py").write_text(AUDIT_SCRIPT, encoding="utf-8")
    proc = _torchrepro(folder, "audit", "--json", "audited.py", ctx.device)
    report = _verdict(proc)
    if report is None:
        return [_failed_command(check, "torchrepro audit", proc)]
    found = {(f["code"], f["location"]): f for f in report.get("findings", [])}
    grid_op = "aten.cudnn_grid_sampler_backward" if ctx.cuda else "aten.grid_sampler_2d_backward"
    grid = found.get(("TR115", _audit_line("grid-sample")), {})
    # on CUDA the branch runs: one runtime finding (no line); on the CPU: the line, as not taken
    switch = found.get(("TR203", None if ctx.cuda else _audit_line("switch-on-cuda")), {})
    scatter = found.get(("TR133", _audit_line("scatter-multiply")), {})
    expected = {
        # on CUDA cuDNN's sampler runs, which strict mode does not stop: an error that says so
        "grid_sample": grid.get("severity") == "error"
        and grid.get("op") == grid_op
        and (("does not stop" in grid.get("message", "")) == ctx.cuda),
        "scatter multiply": scatter.get("severity") == "error",
        "clock-seeded generator": ("TR305", _audit_line("clock-seed")) in found,
        # the branch runs on CUDA (reported as it ran), not on the CPU (reported as not taken)
        "cudnn.benchmark on CUDA only": bool(switch)
        and (("branch not taken" in switch.get("message", "")) != ctx.cuda),
    }
    missing = [name for name, ok in expected.items() if not ok]
    detail = (
        f"python -m torchrepro audit --json on {ctx.device}: exit {proc.returncode}; "
        + ("found " + ", ".join(expected) if not missing else "missed: " + ", ".join(missing))
        + f" (codes: {sorted({code for code, _ in found})})"
    )
    status = "pass" if not missing and proc.returncode == 1 else "fail"
    findings = report.get("findings", [])
    return [_row(check, status, detail, device=ctx.device, returncode=proc.returncode, findings=findings)]


# --------------------------------------------------------------------------------------------

CHECKS: list[tuple[str, Callable[[Context], list[Row]]]] = [
    ("seeded_loader_pin_memory", check_loader),
    ("rng_state_cuda", check_rng),
    ("checkpoint_resume_cuda", check_checkpoint),
    ("check_reproducible", check_reproducible),
    ("check_divergence", check_broken),
    ("run_record_compare", check_run_record),
    ("audit_on_device", check_audit),
    ("invariant_data_parallel", check_invariant_data_parallel),
    ("invariant_fsdp_cuda", check_invariant_fsdp),
]
"""(the first row's check name, the function): the name labels an ``error`` row if it raises."""


def _guarded(name: str, fn: Callable[[Context], list[Row]], ctx: Context) -> list[Row]:
    try:
        return fn(ctx)
    except subprocess.TimeoutExpired as exc:
        return [_row(name, "error", f"a child ran past {exc.timeout:.0f} s: {' '.join(map(str, exc.cmd))}")]
    except Exception as exc:  # one broken check must not cost the others their rows
        return [_row(name, "error", f"{type(exc).__name__}: {exc}")]


def run(ctx: Context) -> list[Row]:
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    workers = max(2, min(4, (os.cpu_count() or 2) // 4))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(_guarded, name, fn, ctx) for name, fn in CHECKS]
        return [row for future in futures for row in future.result()]
