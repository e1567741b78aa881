"""Item 1: strict mode gives equal bits across fresh processes; what strict off gives, measured.

Invariants:

- Every run is a fresh process (``python -c``-style child), started the same way; the only
  difference between the two runs of a pair is the process itself (its address space, its
  allocator, cuDNN's algorithm search, the atomics' order).
- ``strict``: ``torchrepro.set_determinism("strict")`` before CUDA starts (it sets
  ``CUBLAS_WORKSPACE_CONFIG``), then ``seed_everything``. ``off``: PyTorch's defaults, seeded the
  same. ``fast``: off plus what fast training turns on (``cudnn.benchmark``, TF32 in matmuls and
  cuDNN). Strict's pairs must be equal (``pass``/``fail``); off's and fast's are measured
  (``info``: equal or where they part), never assumed.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from gpu_checks.common import ChildResult, Context, Row, run_python
from gpu_checks.models import MODELS, first_difference

NAME = "bitwise"
MODES = ("strict", "off", "fast")

_CHILD = """
import json, sys
import torch
import torchrepro
from gpu_checks import models

mode, size, steps, device = {mode!r}, {size!r}, {steps!r}, {device!r}
torchrepro.set_determinism("off" if mode == "fast" else mode)
if mode == "fast":
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
torchrepro.seed_everything(0)
out = {{}}
for name in models.MODELS:
    try:
        out[name] = models.train(name, size, steps, device)
    except Exception as e:  # a strict-mode refusal is a result, reported by the parent
        out[name] = {{"error": type(e).__name__ + ": " + str(e).strip().splitlines()[0][:400]}}
print(json.dumps(out))
"""


def _one(ctx: Context, mode: str, run: int) -> ChildResult:
    size, steps = ("tiny", 3) if ctx.quick else ("check", 12)
    code = _CHILD.format(mode=mode, size=size, steps=steps, device=ctx.device)
    return run_python(code, cwd=ctx.workdir / f"{mode}{run}", timeout=240)


def compare_runs(mode: str, model: str, a: dict[str, Any], b: dict[str, Any], cuda: bool) -> Row:
    """The row for one model's pair of runs in one mode."""
    check = f"{model}, {mode}: two fresh processes end with equal bits"
    data = {"mode": mode, "model": model, "a": a, "b": b}
    if "error" in a or "error" in b:
        return Row(
            NAME,
            check,
            "fail" if mode == "strict" else "info",
            f"a run raised: {a.get('error') or b.get('error')}",
            data,
        )
    where = first_difference(a, b)
    if mode == "strict":
        status = "pass" if where is None else "fail"
        if not cuda and status == "pass":
            status = "info"  # equal on the CPU says nothing about CUDA
    else:
        status = "info"
    detail = "equal bits" if where is None else f"differ: first at {where}"
    return Row(NAME, check, status, detail + ("" if cuda else " (on the CPU)"), data)


def run(ctx: Context) -> list[Row]:
    jobs = [(mode, i) for mode in MODES for i in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = dict(zip(jobs, pool.map(lambda job: _one(ctx, *job), jobs), strict=True))
    rows = []
    for mode in MODES:
        a, b = results[(mode, 0)], results[(mode, 1)]
        broken = [r for r in (a, b) if r.returncode != 0 or not isinstance(r.result, dict)]
        if broken:
            rows.append(
                Row(
                    NAME,
                    f"{mode}: training processes",
                    "error",
                    f"exit {broken[0].returncode}: {broken[0].tail()}",
                )
            )
            continue
        for model in MODELS:
            rows.append(compare_runs(mode, model, a.result[model], b.result[model], ctx.cuda))
    return rows
