"""Item 3: ``CUBLAS_WORKSPACE_CONFIG`` set too late is refused; ``torchrepro run`` sets it in time.

Invariants:

- Each claim is checked in a fresh process, since cuBLAS reads the variable once, when the first
  cuBLAS handle is made.
- ``too_late``: a process multiplies on CUDA (cuBLAS starts without the variable), then calls
  ``set_determinism("strict")``: it must raise ``DeterminismError`` naming the variable and the
  fix. PyTorch's own refusal (``use_deterministic_algorithms(True)`` then a matmul, variable
  unset) is recorded beside it.
- ``under_run``: the same script started by ``python -m torchrepro run --mode strict`` runs its
  matmuls with deterministic algorithms on and the variable set, without an error.
- ``bits``: a matmul-heavy step (a wide MLP, batched matmuls, and two CUDA streams multiplying at
  once) in two processes with the variable (strict) and two without it (PyTorch's defaults):
  equal bits with it is the claim; without it is measured.
"""

from __future__ import annotations

import concurrent.futures
import sys

from gpu_checks.common import ChildResult, Context, Row, run_python

NAME = "cublas"

_TOO_LATE = """
import json, os
import torch
import torchrepro
device = {device!r}
x = torch.randn(256, 256, device=device)
(x @ x).sum().item()  # cuBLAS starts here, without CUBLAS_WORKSPACE_CONFIG
out = {{"cuda_started": torch.cuda.is_initialized()}}
try:
    torchrepro.set_determinism("strict")
    out["torchrepro"] = None
except Exception as e:
    out["torchrepro"] = [type(e).__name__, str(e)]
os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
torch.use_deterministic_algorithms(True)
try:
    (x @ x).sum().item()
    out["pytorch"] = None
except Exception as e:
    out["pytorch"] = [type(e).__name__, str(e)]
torch.use_deterministic_algorithms(False)
print(json.dumps(out))
"""

_UNDER_RUN = """
import json, os
import torch
device = {device!r}
x = torch.randn(256, 256, device=device)
value = (x @ x @ x).sum().item()
print(json.dumps({{
    "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    "deterministic": torch.are_deterministic_algorithms_enabled(),
    "value": value,
}}))
"""

_BITS = """
import json
import torch
import torchrepro
device, strict, n = {device!r}, {strict!r}, {n!r}
if strict:
    torchrepro.set_determinism("strict")
torchrepro.seed_everything(0)
g = torch.Generator().manual_seed(0)
mlp = torch.nn.Sequential(
    torch.nn.Linear(n, 4 * n), torch.nn.GELU(), torch.nn.Linear(4 * n, n)
).to(device)
opt = torch.optim.SGD(mlp.parameters(), lr=1e-3)
a = torch.randn(16, n // 4, n // 4, generator=g).to(device)
x = torch.randn(4 * n, n, generator=g).to(device)
for _ in range(3):
    opt.zero_grad()
    loss = mlp(x).pow(2).mean() + torch.bmm(a, a.transpose(1, 2)).mean()
    loss.backward()
    opt.step()
streams = []
if device == "cuda":
    outs = []
    for i in range(2):  # two streams on the same cuBLAS handle, multiplying at once
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = x
            for _ in range(4):
                y = torch.tanh(y @ mlp[0].weight.t() @ mlp[2].weight.t())
            outs.append(y)
        streams.append(s)
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
else:
    outs = [x @ mlp[0].weight.t()]
print(json.dumps({{
    "params": torchrepro.fingerprint(mlp.state_dict()),
    "streams": torchrepro.fingerprint(outs),
    "loss": float(loss),
}}))
"""


def _child(ctx: Context, name: str, code: str, *, under_run: bool = False) -> ChildResult:
    prefix = ("-m", "torchrepro", "run", "--mode", "strict") if under_run else ()
    return run_python(code, cwd=ctx.workdir / name, argv_prefix=prefix, timeout=180)


def too_late_row(ctx: Context, r: ChildResult) -> Row:
    check = "cuBLAS started before set_determinism: DeterminismError with the fix"
    if not isinstance(r.result, dict):
        return Row(NAME, check, "error", f"exit {r.returncode}: {r.tail()}")
    ours, theirs = r.result["torchrepro"], r.result["pytorch"]
    data = {"torchrepro": ours, "pytorch": theirs, "cuda_started": r.result["cuda_started"]}
    if not ctx.cuda:
        status = "skip" if ours is None else "fail"  # on the CPU nothing is too late
        return Row(
            NAME, check, status, "needs CUDA (on the CPU, cuBLAS never starts: no error, as it should)", data
        )
    good = (
        ours is not None
        and ours[0] == "DeterminismError"
        and "CUBLAS_WORKSPACE_CONFIG" in ours[1]
        and "torchrepro run" in ours[1]
    )
    detail = "raised " + (f"{ours[0]}: {ours[1].splitlines()[0][:200]}" if ours else "nothing")
    detail += "; PyTorch alone: " + (
        f"{theirs[0]}: {theirs[1].splitlines()[0][:160]}" if theirs else "no error"
    )
    return Row(NAME, check, "pass" if good else "fail", detail, data)


def under_run_row(ctx: Context, r: ChildResult) -> Row:
    check = "started under `torchrepro run --mode strict`: matmuls run, variable set in time"
    if not isinstance(r.result, dict) or r.returncode != 0:
        return Row(NAME, check, "fail" if ctx.cuda else "error", f"exit {r.returncode}: {r.tail()}")
    good = r.result["deterministic"] and r.result["cublas"] in (":4096:8", ":16:8")
    status = ("pass" if good else "fail") if ctx.cuda else ("info" if good else "fail")
    return Row(
        NAME,
        check,
        status,
        f"CUBLAS_WORKSPACE_CONFIG={r.result['cublas']}, deterministic={r.result['deterministic']}",
        r.result,
    )


def bits_rows(ctx: Context, runs: dict[str, ChildResult]) -> list[Row]:
    rows = []
    for strict in (True, False):
        a, b = runs[f"bits{int(strict)}0"], runs[f"bits{int(strict)}1"]
        label = "with the variable (strict)" if strict else "without it (PyTorch defaults)"
        check = f"matmul-heavy step {label}: two processes equal"
        if not (isinstance(a.result, dict) and isinstance(b.result, dict)):
            broken = a if not isinstance(a.result, dict) else b
            rows.append(Row(NAME, check, "error", f"exit {broken.returncode}: {broken.tail()}"))
            continue
        equal = a.result == b.result
        parts = [k for k in ("params", "streams") if a.result[k] != b.result[k]]
        detail = "equal bits" if equal else "differ in " + ", ".join(parts or ["loss"])
        status = ("pass" if equal else "fail") if strict and ctx.cuda else "info"
        rows.append(Row(NAME, check, status, detail, {"a": a.result, "b": b.result}))
    with_, without = runs["bits10"].result, runs["bits00"].result
    if isinstance(with_, dict) and isinstance(without, dict):
        same = with_ == without
        rows.append(
            Row(
                NAME,
                "matmul-heavy step: strict's bits vs PyTorch defaults' bits",
                "info",
                "equal" if same else "differ (expected where TF32 or the workspace changes the kernels)",
                {"strict": with_, "defaults": without},
            )
        )
    return rows


def run(ctx: Context) -> list[Row]:
    n = 64 if ctx.quick else 1024
    jobs = {
        "too_late": (_TOO_LATE.format(device=ctx.device), False),
        "under_run": (_UNDER_RUN.format(device=ctx.device), True),
    }
    for strict in (True, False):
        for i in (0, 1):
            jobs[f"bits{int(strict)}{i}"] = (_BITS.format(device=ctx.device, strict=strict, n=n), False)
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {k: pool.submit(_child, ctx, k, code, under_run=u) for k, (code, u) in jobs.items()}
        runs = {k: f.result() for k, f in futures.items()}
    return [too_late_row(ctx, runs["too_late"]), under_run_row(ctx, runs["under_run"]), *bits_rows(ctx, runs)]


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run through benchmarks/gpu_validation.py --section cublas")
