"""``torchrepro.status()``: every determinism setting of this process, and what falls short.

Invariants: reads, never writes (no switch, no variable, no RNG); settings only a launcher can fix
(the hash seed, the thread counts, the CPU capability, CUDA already started) are marked
``process_start``; each shortfall carries the exact fix.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from torchrepro import _runtime
from torchrepro._compat import lazy_import
from torchrepro.flags import (
    CUBLAS_CONFIGS,
    CUBLAS_VAR,
    FP32_FULL_PRECISION,
    MODES,
    DeterminismFlags,
    cublas_fix,
)
from torchrepro.protocol import HASH_SEED_VAR, MKL_THREADS_VAR, OMP_THREADS_VAR

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")  # imported on first use: the CLI parent needs only the constants

__all__ = ["StatusItem", "StatusReport", "status"]


JsonValue = bool | int | float | str | None


@dataclass(frozen=True)
class StatusItem:
    """One determinism setting: its value, what strict mode wants, and the fix when it falls short.

    ``process_start`` items (hash seed, threads, CPU capability, CUDA started) can only be fixed
    before the interpreter or torch starts, e.g. with ``torchrepro run``.
    """

    name: str
    value: JsonValue
    wanted: JsonValue
    ok: bool
    fix: str
    process_start: bool = False

    def to_dict(self) -> dict[str, JsonValue]:
        """JSON-able dict of the fields."""
        return asdict(self)


@dataclass(frozen=True)
class StatusReport:
    """Every determinism switch and process-start setting, and what falls short of strict.

    ``deterministic`` is True when every switch is as strict mode sets it (never under
    warn-only); ``pinned`` when every process-start setting is fixed as well, so results also
    hold across runs started differently. ``mode`` names the mode the switches match, or
    ``"custom"``.
    """

    items: tuple[StatusItem, ...]
    mode: str

    @property
    def deterministic(self) -> bool:
        """Every runtime switch is as strict mode wants (always False under warn-only)."""
        return all(item.ok for item in self.items if not item.process_start)

    @property
    def pinned(self) -> bool:
        """Every process-start setting (hash seed, threads, CPU capability) is fixed."""
        return all(item.ok for item in self.items if item.process_start)

    @property
    def shortfalls(self) -> tuple[StatusItem, ...]:
        """The items that fall short, in report order."""
        return tuple(item for item in self.items if not item.ok)

    def __getitem__(self, name: str) -> StatusItem:
        for item in self.items:
            if item.name == name:
                return item
        raise KeyError(f"no status item {name!r}; items: {[i.name for i in self.items]}")

    def __str__(self) -> str:
        """A table a person reads: one line per setting (ok, name, value, what strict wants), the
        fix under each one that falls short, and the verdict first.

        >>> print(StatusReport((StatusItem("cudnn.benchmark", True, False, False, "set it off"),), "custom"))
        determinism: custom switches (not deterministic); process-start settings fixed
          NO  cudnn.benchmark  True  (strict wants False)
                               fix: set it off
        """
        state = "deterministic" if self.deterministic else "not deterministic"
        start = "process-start settings fixed" if self.pinned else "process-start settings not fixed"
        mode = f"{self.mode} mode" if self.mode in MODES else f"{self.mode} switches"
        lines = [f"determinism: {mode} ({state}); {start}"]
        width = max((len(item.name) for item in self.items), default=0)
        for item in self.items:
            value, wanted = _shown(item.value), _shown(item.wanted)
            line = f"  {'ok' if item.ok else 'NO':<3} {item.name:<{width}}  {value}"
            if not item.ok:
                line += f"  (strict wants {wanted})"
            lines.append(line)
            if item.fix:
                lines.append(f"  {'':<3} {'':<{width}}  fix: {item.fix}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: ``mode``, ``deterministic``, ``pinned`` and every item."""
        return {
            "mode": self.mode,
            "deterministic": self.deterministic,
            "pinned": self.pinned,
            "items": [item.to_dict() for item in self.items],
        }


def _shown(value: JsonValue) -> str:
    return "unset" if value is None else repr(value) if isinstance(value, str) and not value else str(value)


_STRICT_FIX = "call torchrepro.set_determinism('strict')"


def _switch(name: str, value: JsonValue, wanted: JsonValue, fix: str = _STRICT_FIX) -> StatusItem:
    ok = value == wanted
    return StatusItem(name, value, wanted, ok, "" if ok else fix)


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _mode_of(flags: DeterminismFlags) -> str:
    current = (
        flags.deterministic_algorithms,
        flags.warn_only,
        flags.cudnn_deterministic,
        flags.cudnn_benchmark,
        flags.cuda_matmul_allow_tf32,
        flags.cudnn_allow_tf32,
        flags.float32_matmul_precision,
    )
    full_fp32 = all(v in FP32_FULL_PRECISION for _, v in flags.fp32_precision)
    if current == (True, False, True, False, False, False, "highest") and full_fp32:
        return "strict"
    if current == (True, True, True, False, False, False, "highest") and full_fp32:
        return "warn"
    if current[:2] == (False, False) and current[2:] == (False, False, False, True, "highest"):
        return "off"
    return "custom"


def status() -> StatusReport:
    """Report every determinism switch and process-start setting, and what falls short.

    Only reads: changes nothing and never initialises CUDA. Rendering is the CLI's job.
    """
    flags = DeterminismFlags.capture()
    items = [
        _switch("deterministic_algorithms", flags.deterministic_algorithms, True),
        _switch(
            "warn_only",
            flags.warn_only,
            False,
            _STRICT_FIX + " (warn-only reports nondeterministic ops but still runs them)",
        ),
        _switch("cudnn.deterministic", flags.cudnn_deterministic, True),
        _switch("cudnn.benchmark", flags.cudnn_benchmark, False),
        _switch("cuda.matmul.allow_tf32", flags.cuda_matmul_allow_tf32, False),
        _switch("cudnn.allow_tf32", flags.cudnn_allow_tf32, False),
        _switch("float32_matmul_precision", flags.float32_matmul_precision, "highest"),
    ]
    if flags.fp32_precision:
        reduced = [f"{k}={v}" for k, v in flags.fp32_precision if v not in FP32_FULL_PRECISION]
        value = ", ".join(f"{k}={v}" for k, v in flags.fp32_precision)
        items.append(
            StatusItem(
                "fp32_precision",
                value,
                "every backend none or ieee (full float32)",
                not reduced,
                "" if not reduced else f"{_STRICT_FIX} (reduced precision: {', '.join(reduced)})",
            )
        )
    items.append(
        _switch(
            "fill_uninitialized_memory",
            flags.fill_uninitialized_memory,
            True,
            "set torch.utils.deterministic.fill_uninitialized_memory = True",
        )
    )
    items.append(
        _switch(
            "inductor.fallback_random",
            flags.inductor_fallback_random,
            True,
            _STRICT_FIX + " (or torch._inductor.config.fallback_random = True): torch.compile's random "
            "ops then draw from the global generator as eager's do, so compiling keeps the dropout masks",
        )
    )
    cublas = flags.cublas_workspace_config
    items.append(
        StatusItem(
            CUBLAS_VAR,
            cublas,
            " or ".join(CUBLAS_CONFIGS),
            cublas in CUBLAS_CONFIGS,
            "" if cublas in CUBLAS_CONFIGS else cublas_fix(),
        )
    )
    items.extend(_process_items(cublas))
    return StatusReport(items=tuple(items), mode=_mode_of(flags))


def _process_items(cublas: str | None) -> list[StatusItem]:
    hash_seed = os.environ.get(HASH_SEED_VAR)
    hash_fixed = sys.flags.hash_randomization == 0 or (hash_seed is not None and hash_seed.isdigit())
    threads = torch.get_num_threads()
    omp, mkl = os.environ.get(OMP_THREADS_VAR), os.environ.get(MKL_THREADS_VAR)
    threads_pinned = _env_int(OMP_THREADS_VAR) == threads
    capability = str(torch.backends.cpu.get_cpu_capability())
    aten_isa = os.environ.get("ATEN_CPU_CAPABILITY")
    cuda_started = _runtime.cuda_started()
    cuda_ok = not cuda_started or cublas in CUBLAS_CONFIGS
    return [
        StatusItem(
            HASH_SEED_VAR,
            f"PYTHONHASHSEED={hash_seed}, sys.flags.hash_randomization={sys.flags.hash_randomization}",
            "a fixed integer set before the interpreter starts",
            hash_fixed,
            ""
            if hash_fixed
            else "start Python with PYTHONHASHSEED=0 (or use `torchrepro run`); setting it inside "
            "the script has no effect",
            process_start=True,
        ),
        StatusItem(
            "threads",
            f"torch={threads}, interop={torch.get_num_interop_threads()}, "
            f"OMP_NUM_THREADS={omp}, MKL_NUM_THREADS={mkl}",
            "OMP_NUM_THREADS set and equal to torch.get_num_threads()",
            threads_pinned,
            ""
            if threads_pinned
            else f"start the process with OMP_NUM_THREADS={threads} (or `torchrepro run --threads N`); "
            "CPU results change with the thread count",
            process_start=True,
        ),
        StatusItem(
            "cpu_capability",
            f"{capability} (ATEN_CPU_CAPABILITY={aten_isa})",
            "ATEN_CPU_CAPABILITY set before torch starts",
            aten_isa is not None,
            ""
            if aten_isa is not None
            else f"start the process with ATEN_CPU_CAPABILITY={capability.lower()} (or `torchrepro run "
            f"--cpu-capability {capability.lower()}`); "
            "CPU results change with the instruction set",
            process_start=True,
        ),
        StatusItem(
            "cuda_initialized",
            cuda_started,
            f"CUDA started only after {CUBLAS_VAR} is set",
            cuda_ok,
            "" if cuda_ok else cublas_fix(),
            process_start=True,
        ),
    ]
