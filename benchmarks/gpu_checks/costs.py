"""Item 4: what each determinism switch costs on the GPU, step times side by side in one process.

Invariants:

- One process, started with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (deterministic algorithms need
  it before cuBLAS starts), times every configuration of every model, interleaved: round after
  round, each configuration in turn, so drift of the clock or the machine falls on all of them.
- Each configuration is applied from PyTorch's defaults (``set_determinism("off")``), then
  changed; warm-up steps run before the timed ones (cuDNN's benchmark search among them).
- A step time is the median over rounds of the mean of the timed steps, measured with a device
  synchronisation at both ends. The ratios compare two configurations that differ in one switch.
"""

from __future__ import annotations

import statistics
from typing import Any

from gpu_checks.common import Context, Row, child_env, run_python

NAME = "costs"

# name -> (description, switches applied on top of PyTorch's defaults)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "defaults": ("PyTorch defaults", {}),
    "benchmark": ("cudnn.benchmark on", {"benchmark": True}),
    "deterministic": ("deterministic algorithms (fill off)", {"deterministic": True, "fill": False}),
    "fill": ("deterministic algorithms + fill_uninitialized_memory", {"deterministic": True, "fill": True}),
    "tf32_off": ("TF32 off in cuDNN too", {"cudnn_tf32": False}),
    "fast": ("benchmark + TF32 everywhere", {"benchmark": True, "cudnn_tf32": True, "matmul_tf32": True}),
    "strict": ("torchrepro strict", {"strict": True}),
}

# claim -> (slower configuration, faster configuration): the cost of the switch is slower / faster
RATIOS: dict[str, tuple[str, str]] = {
    "cudnn.benchmark off": ("defaults", "benchmark"),
    "deterministic algorithms": ("deterministic", "defaults"),
    "fill_uninitialized_memory": ("fill", "deterministic"),
    "TF32 off (cuDNN)": ("tf32_off", "defaults"),
    "strict vs PyTorch defaults": ("strict", "defaults"),
    "strict vs fast (benchmark + TF32)": ("strict", "fast"),
}

_CHILD = """
import json, random, statistics, time
import torch
import torchrepro
from gpu_checks import models
from gpu_checks.costs import CONFIGS

device, size, rounds, warm, timed = {device!r}, {size!r}, {rounds!r}, {warm!r}, {timed!r}

def apply(switches):
    torchrepro.set_determinism("strict" if switches.get("strict") else "off")
    if switches.get("strict"):
        return
    torch.backends.cudnn.benchmark = switches.get("benchmark", False)
    if "deterministic" in switches:
        torch.use_deterministic_algorithms(switches["deterministic"])
        torch.backends.cudnn.deterministic = switches["deterministic"]
    if "fill" in switches:
        torch.utils.deterministic.fill_uninitialized_memory = switches["fill"]
    if "cudnn_tf32" in switches:
        torch.backends.cudnn.allow_tf32 = switches["cudnn_tf32"]
    if "matmul_tf32" in switches:
        torch.backends.cuda.matmul.allow_tf32 = switches["matmul_tf32"]

def sync():
    if device == "cuda":
        torch.cuda.synchronize()

torchrepro.seed_everything(0)
out = {{"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "cuda": torch.version.cuda, "times": {{}}, "errors": {{}}}}
order = list(CONFIGS)
shuffle = random.Random(0)
for name in models.MODELS:
    net, opt = models.build(name, size, device)
    step = models.step_fn(name, net, opt, device)
    data = [models.batch(name, size, i, device) for i in range(2)]
    times = {{c: [] for c in order}}
    for r in range(rounds):
        shuffle.shuffle(order)
        for c in order:
            if c in out["errors"].get(name, {{}}):
                continue
            try:
                apply(CONFIGS[c][1])
                for i in range(warm):
                    step(*data[i % 2])
                sync()
                t = time.perf_counter()
                for i in range(timed):
                    step(*data[i % 2])
                sync()
                times[c].append((time.perf_counter() - t) / timed)
            except Exception as e:
                first = str(e).strip().splitlines()[0][:300]
                out["errors"].setdefault(name, {{}})[c] = type(e).__name__ + ": " + first
    torchrepro.set_determinism("off")
    out["times"][name] = times
print(json.dumps(out))
"""


def summarise(result: dict[str, Any], cuda: bool) -> list[Row]:
    """Rows from the child's timings: one per model with every configuration's median step time
    and the ratios of ``RATIOS``; a configuration that raised is named, not timed."""
    rows = []
    where = f"{result['gpu']}, torch {result['torch']}, CUDA {result['cuda']}"
    for model, times in result["times"].items():
        medians = {c: statistics.median(ts) for c, ts in times.items() if ts}
        ratios = {
            claim: medians[slow] / medians[fast]
            for claim, (slow, fast) in RATIOS.items()
            if slow in medians and fast in medians
        }
        errors = result["errors"].get(model, {})
        detail = ", ".join(f"{claim} {ratio:.2f}x" for claim, ratio in ratios.items())
        if errors:
            detail += "; raised: " + "; ".join(f"{c}: {e}" for c, e in errors.items())
        rows.append(
            Row(
                NAME,
                f"{model}: cost of each switch ({where})",
                "info",
                detail,
                {"model": model, "median_step_s": medians, "ratios": ratios, "errors": errors, "on": where},
            )
        )
    return rows


def run(ctx: Context) -> list[Row]:
    size, rounds, warm, timed = ("tiny", 2, 1, 2) if ctx.quick else ("cost", 9, 3, 10)
    code = _CHILD.format(device=ctx.device, size=size, rounds=rounds, warm=warm, timed=timed)
    r = run_python(
        code, cwd=ctx.workdir / "costs", env=child_env(CUBLAS_WORKSPACE_CONFIG=":4096:8"), timeout=400
    )
    if r.returncode != 0 or not isinstance(r.result, dict):
        return [Row(NAME, "step times of every configuration", "error", f"exit {r.returncode}: {r.tail()}")]
    return summarise(r.result, ctx.cuda)
