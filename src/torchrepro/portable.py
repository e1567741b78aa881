"""Portable mode: CPU results that do not change with the thread count or the CPU's instruction set.

What it sets (``torchrepro run|check --portable``, ``relaunch(portable=True)``):
- ``MKL_CBWR=AVX2,STRICT`` (oneMKL's conditional numerical reproducibility, read once when oneMKL
  starts: in strict mode its GEMMs give the same bits for any thread count), unless the
  environment already holds a value oneMKL accepts, which is kept;
- ``ATEN_CPU_CAPABILITY=avx2`` on an x86 CPU with AVX2 (the SIMD kernels torch dispatches to),
  unless the environment or ``--cpu-capability`` already names one, which is kept;
- oneDNN off in the child (``torch.backends.mkldnn.enabled = False``) before the script runs:
  oneDNN's convolution backward splits its reductions by thread.

Invariants:
- Standard library only, and nothing here writes ``os.environ``: ``start_values`` returns the
  variables a process must start with, the launcher (``ChildSpec.to_env``) or ``relaunch`` puts
  them in place. ``disable_onednn`` is the one function that writes torch state.
- A value the user set that oneMKL or torch would not accept is an error naming it (``SettingsError``),
  never silently replaced; a valid one is kept, and ``notes`` says when it weakens the mode.
- This module is the only one that spells an ``MKL_CBWR`` value, and it owns the values of
  ``ATEN_CPU_CAPABILITY`` torch accepts (``protocol`` re-exports them).

Measured (torch 2.13.0 CPU, 1 vs 2 threads): a small CNN's gradients are bitwise equal with this
mode and differ without it. Ops whose CPU kernel still splits a reduction by thread are named by
the audit (``audit.threads``), not hidden.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Mapping

from torchrepro.errors import SettingsError

__all__ = [
    "CBWR_DEFAULT",
    "CBWR_VAR",
    "CPU_CAPABILITIES",
    "CPU_CAPABILITY_VAR",
    "disable_onednn",
    "notes",
    "portable_isa",
    "start_values",
]

CBWR_VAR = "MKL_CBWR"
CBWR_DEFAULT = "AVX2,STRICT"
"""oneMKL's AVX2 branch in strict mode: its GEMMs the same for any thread count and on every CPU
with AVX2 (oneMKL's documentation: ``?gemm``, ``?symm``, ``?hemm``, ``?trsm``)."""

CPU_CAPABILITY_VAR = "ATEN_CPU_CAPABILITY"
CPU_CAPABILITIES = ("default", "avx2", "avx512", "sve256", "zvector")
"""Values of ``ATEN_CPU_CAPABILITY`` PyTorch accepts (the ISA its CPU kernels are dispatched to)."""
_PORTABLE_ISA = "avx2"

# oneMKL's documented syntax: "<branch>[,STRICT]" or "BRANCH=<branch>[,STRICT]"
_BRANCHES = (
    "AUTO|COMPATIBLE|SSE2|SSE3|SSSE3|SSE4_1|SSE4_2|AVX|AVX2(?:_E\\d)?|AVX512(?:_E\\d)?"
    "|AVX512_MIC(?:_E\\d)?|AVX10(?:_\\w+)?"
)
_CBWR = re.compile(rf"(?:BRANCH=)?(?P<branch>{_BRANCHES})(?P<strict>,STRICT)?", re.IGNORECASE)
_STRICT_BRANCH = re.compile(r"AVX2|AVX512", re.IGNORECASE)
_X86 = ("x86_64", "amd64", "i386", "i686", "x86")


def _cbwr_strict(value: str) -> bool:
    """Whether ``value`` is oneMKL's strict mode on a branch that supports it (AVX2, AVX-512)."""
    match = _CBWR.fullmatch(value.strip())
    return bool(match and match["strict"] and _STRICT_BRANCH.fullmatch(match["branch"]))


def _cpu_flags() -> frozenset[str] | None:
    """The first CPU's flags from ``/proc/cpuinfo`` (None: not Linux, or unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip().lower() in ("flags", "features"):
                    return frozenset(value.split())
    except OSError:
        return None
    return None


def portable_isa(machine: str | None = None, flags: frozenset[str] | None = None) -> str | None:
    """The ``ATEN_CPU_CAPABILITY`` portable mode pins: ``avx2`` on an x86 CPU with AVX2, ``default``
    on one without; None where it pins nothing (not x86, or the CPU's flags cannot be read).

    >>> portable_isa("x86_64", frozenset({"sse2", "avx2", "avx512f"}))
    'avx2'
    >>> portable_isa("x86_64", frozenset({"sse2"})), portable_isa("aarch64", frozenset({"asimd"}))
    ('default', None)
    """
    machine = (platform.machine() if machine is None else machine).lower()
    if machine not in _X86:
        return None
    flags = _cpu_flags() if flags is None else flags
    if flags is None:
        return None
    return _PORTABLE_ISA if "avx2" in flags else "default"


def start_values(
    base: Mapping[str, str], *, cpu_capability: str | None = None, isa: str | None = None
) -> dict[str, str]:
    """The variables a portable process starts with, given its environment ``base``.

    ``MKL_CBWR``: the base's value when oneMKL accepts it, else ``AVX2,STRICT``.
    ``ATEN_CPU_CAPABILITY``: ``cpu_capability`` (``--cpu-capability``), else the base's value, else
    ``isa`` (default: ``portable_isa()``); left out when none applies. Raises ``SettingsError``
    naming a value the user set that oneMKL or torch would not accept.

    >>> start_values({}, isa="avx2")
    {'MKL_CBWR': 'AVX2,STRICT', 'ATEN_CPU_CAPABILITY': 'avx2'}
    >>> start_values({"MKL_CBWR": "AVX512,STRICT", "ATEN_CPU_CAPABILITY": "avx512"})
    {'MKL_CBWR': 'AVX512,STRICT', 'ATEN_CPU_CAPABILITY': 'avx512'}
    """
    values: dict[str, str] = {}
    cbwr = base.get(CBWR_VAR)
    if cbwr:
        if not _CBWR.fullmatch(cbwr.strip()):
            raise SettingsError(
                f"--portable: {CBWR_VAR}={cbwr!r} in the environment is not a value oneMKL accepts "
                f"(<branch>[,STRICT], e.g. {CBWR_DEFAULT}); unset it to get {CBWR_DEFAULT}, or fix it"
            )
        values[CBWR_VAR] = cbwr
    else:
        values[CBWR_VAR] = CBWR_DEFAULT
    user_isa = base.get(CPU_CAPABILITY_VAR)
    if cpu_capability is None and user_isa and user_isa not in CPU_CAPABILITIES:
        raise SettingsError(
            f"--portable: {CPU_CAPABILITY_VAR}={user_isa!r} in the environment is not a value torch "
            f"accepts (one of {', '.join(CPU_CAPABILITIES)}); unset it to get {_PORTABLE_ISA} on a CPU "
            "with AVX2, or fix it"
        )
    chosen = cpu_capability or user_isa or (portable_isa() if isa is None else isa)
    if chosen:
        values[CPU_CAPABILITY_VAR] = chosen
    return values


def notes(values: Mapping[str, str]) -> list[str]:
    """What the user should know about the start values of a portable run (``start_values``'s)."""
    out = []
    cbwr = values.get(CBWR_VAR)
    if cbwr is not None and not _cbwr_strict(cbwr):
        out.append(
            f"--portable kept {CBWR_VAR}={cbwr} from the environment: without STRICT on the AVX2 or "
            "AVX512 branch oneMKL promises its results only for a fixed thread count "
            f"({CBWR_DEFAULT} promises them for any)"
        )
    isa = values.get(CPU_CAPABILITY_VAR)
    if isa is None:
        out.append(
            f"--portable left {CPU_CAPABILITY_VAR} unset (not an x86 CPU, or its flags could not be "
            "read): torch's CPU kernels use whatever this CPU supports"
        )
    elif isa == "default":
        out.append(
            f"--portable pinned {CPU_CAPABILITY_VAR}=default: this CPU has no AVX2, so its results can "
            f"differ from portable runs on CPUs with AVX2 ({_PORTABLE_ISA})"
        )
    return out


def disable_onednn() -> None:
    """Turn oneDNN off in this process (``torch.backends.mkldnn.enabled = False``): its
    convolution backward splits reductions by thread. Portable mode calls it before the script runs.
    """
    import torch

    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
