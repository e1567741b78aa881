"""``check --repro DIR``: a standalone script that shows a located op's difference in seconds.

Invariants:
- Imports no torch (a check's parent never does): the capturing child (``tracing.capture``)
  describes the call; this module decides whether a script can show the difference and writes it.
- Writes into the directory the user named only, and only when it is new or empty: ``prepare_dir``
  refuses anything else before the check starts, ``write_repro`` looks again and creates each file
  exclusively, so nothing already there is overwritten.
- The script imports torch and the standard library only, loads its inputs afresh for every call
  with ``torch.load(weights_only=True)`` (the op may write into them), calls the op by its aten
  overload and compares every output, and every input after the call, bit for bit: exit 1 when
  the difference shows, 0 when not.
- A script is written only for an op whose inputs were bitwise equal and whose outputs differed,
  that draws from no RNG and is no collective; otherwise the reason is returned, never raised.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

from torchrepro import runrecord
from torchrepro.errors import EnvFileError, SettingsError
from torchrepro.results import Repro
from torchrepro.tracing.compare import compare_traces, draws_randomness, load_trace
from torchrepro.tracing.ops import COLLECTIVE_NAMESPACES, OpDivergence

__all__ = [
    "INPUTS_FILE",
    "README_FILE",
    "REPEAT_CALLS",
    "SCRIPT_FILE",
    "Repro",
    "Target",
    "prepare_dir",
    "run_script",
    "target",
    "write_repro",
]

SCRIPT_FILE: Final = "repro.py"
INPUTS_FILE: Final = "inputs.pt"
README_FILE: Final = "README.txt"
REPEAT_CALLS: Final = 5
"""How often the script calls an op whose outputs differed with the same settings."""
RUN_TIMEOUT: Final = 300.0
"""Seconds the check waits for the written script to show the difference (or not)."""

_OP_NAME = re.compile(r"[A-Za-z_]\w*\.\w+\.\w+")


@dataclasses.dataclass(frozen=True)
class Target:
    """The op call to capture: op ``index`` of the traces of ``rank`` (``op``), and the thread
    counts the script calls it with (``threads``: the two a ``--vary threads`` check compared;
    None: the first run's, ``REPEAT_CALLS`` times)."""

    op: OpDivergence
    rank: int
    traces: Path
    threads: tuple[int, int] | None


def prepare_dir(path: str | os.PathLike[str]) -> Path:
    """The absolute path of ``path`` once it is known to be new or an empty directory.

    Raises ``SettingsError`` otherwise: nothing the user saved is ever overwritten.
    """
    where = Path(path).absolute()
    if where.is_symlink():
        raise SettingsError(f"--repro {os.fspath(path)}: is a symbolic link; name a new or empty directory")
    if where.exists() and not where.is_dir():
        raise SettingsError(
            f"--repro {os.fspath(path)}: exists and is not a directory; name a new or empty one"
        )
    if where.is_dir():
        try:
            entries = sorted(p.name for p in where.iterdir())
        except OSError as exc:
            raise SettingsError(f"--repro {os.fspath(path)}: cannot read the directory ({exc})") from None
        if entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise SettingsError(
                f"--repro {os.fspath(path)}: the directory is not empty ({shown}); name a new or empty "
                "directory (nothing in it is overwritten)"
            )
    return where


def target(
    step: int, rank: int, traces: Path | None, *, threads: tuple[int | None, int | None]
) -> Target | str:
    """The call to capture among the traces a check located with (``traces``: the ``locate<j>``
    directory, None when nothing was located), or why no script can show the difference."""
    if traces is None:
        return "no op was located (see the notes above)"
    a, b = (runrecord.trace_path(traces / f"trace-{side}", rank) for side in "ab")
    try:
        d = compare_traces(a, b)
    except Exception as exc:
        return f"the op traces could not be read again ({type(exc).__name__}: {exc})"
    if d is None:
        return f"the op traces of rank {rank} do not differ"
    if d.structural:
        return (
            f"the runs issued different ops at step {step} ({d.op} vs {d.other_op}): control flow parted "
            "in Python, there is no single op call to reproduce"
        )
    if not d.inputs_equal:
        return (
            f"an input of {d.op} already differed between the runs (a value from outside the traced "
            "ops), so calling it on one run's inputs shows nothing"
        )
    if draws_randomness(d.op):
        return (
            f"{d.op} draws from a random number generator: the runs differ in the RNG's state, not in "
            "the op, so a standalone call shows nothing; seed the RNG before that line"
        )
    if d.op.startswith(COLLECTIVE_NAMESPACES):
        return f"{d.op} is a collective: its result depends on the other ranks, not on its inputs"
    if not _OP_NAME.fullmatch(d.op):
        return f"{d.op} is not an aten overload a script can call"
    a_threads, b_threads = threads
    varied = None
    if a_threads is not None and b_threads is not None and a_threads != b_threads:
        varied = (a_threads, b_threads)
    return Target(op=d, rank=rank, traces=traces, threads=varied)


def write_repro(
    directory: Path, chosen: Target, capture: Path, *, where: str, run: bool = True
) -> Repro | str:
    """Write the script, its inputs and a README into ``directory`` from the call captured under the
    prefix ``capture`` and (``run``) run the script once in a fresh process; or say why nothing was
    written. ``where`` says where the check located the op (step, module, line)."""
    tensors, described = runrecord.capture_paths(capture, chosen.rank)
    try:
        call = runrecord.read_json(described)
    except EnvFileError:
        call = None
    if not isinstance(call, dict):
        return "the re-run that saves the op's inputs did not save them (it took another path)"
    if call.get("refused"):
        return str(call["refused"])
    located = load_trace(runrecord.trace_path(chosen.traces / "trace-a", chosen.rank)).records[
        chosen.op.index
    ]
    if (call.get("index"), call.get("op"), tuple(call.get("inputs", ()))) != (
        chosen.op.index,
        chosen.op.op,
        located.inputs,
    ):
        return (
            f"the re-run that saves the inputs of {chosen.op.op} saw other inputs (or another op) at op "
            f"{chosen.op.index} than the located run"
        )
    settings = call["settings"]
    calls = (
        (*chosen.threads[:1], *chosen.threads)
        if chosen.threads
        else (int(settings["threads"]),) * REPEAT_CALLS
    )
    try:
        prepare_dir(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with open(tensors, "rb") as src, open(directory / INPUTS_FILE, "xb") as dst:
            shutil.copyfileobj(src, dst)
        for name, text in (
            (SCRIPT_FILE, _script(call, calls, where=where)),
            (README_FILE, _readme(call, calls, where=where, chosen=chosen)),
        ):
            with open(directory / name, "x", encoding="utf-8") as f:
                f.write(text)
    except (OSError, SettingsError) as exc:
        return f"writing into {directory} failed: {exc}"
    code, output = run_script(directory) if run else (None, "")
    return Repro(
        directory=os.fspath(directory),
        script=os.fspath(directory / SCRIPT_FILE),
        inputs=os.fspath(directory / INPUTS_FILE),
        op=chosen.op.op,
        calls=calls,
        reproduces=None if code not in (0, 1) else code == 1,
        output=output[-_OUTPUT_KEPT:],
    )


_OUTPUT_KEPT = 4000  # characters of the script's output kept in the verdict (its end)


def run_script(directory: Path, *, timeout: float = RUN_TIMEOUT) -> tuple[int | None, str]:
    """Run ``directory``'s script as a user would attach it: a fresh, isolated python (``-I``: no
    ``PYTHONPATH``, no user site, not the check's modules); (exit code or None, its output)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-I", SCRIPT_FILE],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def _claim(calls: tuple[int, ...]) -> str:
    if len(set(calls)) > 1:
        return f"gives other bits with {_threads(calls[0])} than with {_threads(calls[-1])}"
    return f"gives other bits from call to call ({len(calls)} calls, {_threads(calls[0])})"


def _script(call: dict[str, Any], calls: tuple[int, ...], *, where: str) -> str:
    s = call["settings"]
    setup = [
        f"torch.use_deterministic_algorithms({s['deterministic']!r}, warn_only={s['warn_only']!r})",
        f"torch.backends.mkldnn.enabled = {s['mkldnn']!r}",
        f"torch.set_float32_matmul_precision({s['matmul_precision']!r})",
    ]
    if "cudnn_deterministic" in s:
        setup += [
            f"torch.backends.cudnn.deterministic = {s['cudnn_deterministic']!r}",
            f"torch.backends.cudnn.benchmark = {s['cudnn_benchmark']!r}",
            f"torch.backends.cudnn.allow_tf32 = {s['cudnn_tf32']!r}",
            f"torch.backends.cuda.matmul.allow_tf32 = {s['cuda_matmul_tf32']!r}",
        ]
    env = s.get("env") or {}
    start = f"os.environ.update({env!r})  # read when torch starts: set before importing it\n" if env else ""
    return _TEMPLATE.format(
        op=call["op"],
        claim=_claim(calls),
        where=where,
        version=call["torch"],
        start=start,
        setup="\n".join(setup),
        inputs=INPUTS_FILE,
        calls=list(calls),
        args=call["args"],
    )


def _readme(call: dict[str, Any], calls: tuple[int, ...], *, where: str, chosen: Target) -> str:
    tensors = "\n".join(f"  T[{i}]: {t}" for i, t in enumerate(call.get("tensors", [])))
    return (
        f"{call['op']} {_claim(calls)}: every input is bitwise equal.\n\n"
        f"Found by `torchrepro check` {where} (rank {chosen.rank}, op {chosen.op.index} of the step's "
        f"trace), with torch {call['torch']}.\n\n"
        f"  python {SCRIPT_FILE}      exit 1 when the difference reproduces, 0 when it does not\n\n"
        f"{SCRIPT_FILE} needs PyTorch only. {INPUTS_FILE} holds the op's tensor arguments as the run "
        "passed them (dtype, device, shape, strides and storage offset kept; "
        f"torch.load(weights_only=True) reads it):\n{tensors or '  (none)'}\n"
        f"The settings that choose kernels are set as the run had them:\n{json.dumps(call['settings'])}\n"
    )


_TEMPLATE: Final = '''\
"""{op} {claim}, on bitwise-equal inputs.

Found by `torchrepro check --repro` {where}; torch {version} ran it.
Needs PyTorch only: python repro.py  (exit 1: the difference reproduces, 0: it does not)
"""

import os
import sys
from pathlib import Path

{start}import torch

{setup}

OP = torch.ops.{op}
INPUTS = Path(__file__).with_name("{inputs}")
CALLS = {calls}  # the thread count of each call; every call is compared with the first


def call(threads):
    """One call on fresh inputs: its outputs, then its inputs after it (an op may write them)."""
    torch.set_num_threads(threads)
    T = torch.load(INPUTS, weights_only=True)
    out = OP({args})
    results = {{f"output {{i}}": o for i, o in enumerate(out if isinstance(out, (tuple, list)) else [out])}}
    results.update((f"input T[{{i}}] after the call", t) for i, t in enumerate(T))
    return results


def difference(a, b):
    """None when ``a`` and ``b`` are the same bits, else the difference in words."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None if repr(a) == repr(b) else f"{{a!r}} vs {{b!r}}"
    if (a.dtype, a.shape, a.stride()) != (b.dtype, b.shape, b.stride()):
        return f"{{a.dtype}}{{list(a.shape)}} vs {{b.dtype}}{{list(b.shape)}}"
    x, y = (t.detach().cpu().contiguous().reshape(-1) for t in (a, b))
    n = x.element_size()
    differ = (x.view(torch.uint8).view(-1, n) != y.view(torch.uint8).view(-1, n)).any(1)
    if not differ.any():
        return None
    wide = torch.complex128 if x.is_complex() else torch.float64
    largest = (x[differ].to(wide) - y[differ].to(wide)).abs().max().item()
    return f"{{int(differ.sum())}} of {{x.numel()}} elements differ, largest abs difference {{largest:.3g}}"


def main():
    print(f"torch {{torch.__version__}}: {{OP}} called {{len(CALLS)}} times, with {{CALLS}} threads")
    first, differs = call(CALLS[0]), False
    for i, threads in enumerate(CALLS[1:], start=2):
        for name, value in call(threads).items():
            diff = difference(first[name], value)
            if diff is not None:
                differs = True
                print(f"call {{i}} ({{threads}} threads) vs call 1 ({{CALLS[0]}}): {{name}}: {{diff}}")
    print("the difference reproduces" if differs else "no difference: every call gave the same bits")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
'''
