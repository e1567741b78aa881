"""Capturing one op call for a standalone reproduction (``check --repro``): its inputs, saved.

Invariants:
- A capture replays the call exactly: every tensor argument is copied before the op runs, with
  its dtype, device, shape, strides and storage offset (the whole storage is copied, once for
  arguments that share one, so aliasing is kept too); every other argument is written as Python
  source, ``T[i]`` standing for the i-th saved tensor.
- What it writes is a list of plain tensors (``torch.load(weights_only=True)`` reads it) and JSON:
  the op, the call, the settings of the process that decide kernels, and the digests the tracer
  gave the inputs (so the parent can tell that the inputs are those of the op it located).
- A call that its inputs alone do not replay is refused with the reason (``Refused``): an op that
  draws from an RNG, a collective, tensor subclasses and layouts other than strided, opaque
  objects. Refusing writes the reason instead of the tensors.
- Capturing runs inside the dispatch mode's handler (its own ops are not traced) and changes no
  numerics and no RNG state.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch

from torchrepro._io import atomic_write_json
from torchrepro.portable import CBWR_VAR, CPU_CAPABILITY_VAR
from torchrepro.tracing.compare import draws_randomness
from torchrepro.tracing.ops import COLLECTIVE_NAMESPACES

_Copies = dict[tuple[int, int, str], torch.UntypedStorage]
"""Storages copied so far, by (address, size, device): arguments sharing one share the copy."""

__all__ = ["CaptureRequest", "Refused", "Snapshot", "snapshot_call", "write_capture"]

_PROCESS_START_VARS = (CBWR_VAR, CPU_CAPABILITY_VAR)
"""Variables read when torch (or oneMKL) starts that decide CPU kernels: a replay starts with them."""


@dataclasses.dataclass(frozen=True)
class CaptureRequest:
    """Which traced op to capture (its index in the trace) and the two files to write."""

    index: int
    tensors: Path
    call: Path


class Refused(Exception):
    """The call cannot be replayed from its inputs alone; the message says why."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A call's inputs copied before the op ran: ``tensors`` and the call's arguments as source."""

    op: str
    tensors: list[torch.Tensor]
    args: str
    settings: dict[str, Any]


def snapshot_call(op: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Snapshot:
    """Copy the inputs of ``func(*args, **kwargs)`` (before it runs); raises ``Refused``."""
    if op.startswith(COLLECTIVE_NAMESPACES):
        raise Refused(f"{op} is a collective: its result depends on the other ranks")
    if draws_randomness(op) or any("Generator" in str(arg.type) for arg in func._schema.arguments):
        raise Refused(f"{op} draws from a random number generator: the difference is the RNG state")
    copies: _Copies = {}
    tensors: list[torch.Tensor] = []
    parts = [_source(v, tensors, copies) for v in args]
    parts += [f"{k}={_source(v, tensors, copies)}" for k, v in kwargs.items()]
    return Snapshot(op=op, tensors=tensors, args=", ".join(parts), settings=_settings(tensors))


def write_capture(request: CaptureRequest, capture: Snapshot | str, *, index: int, inputs: list[str]) -> None:
    """Write ``capture`` (or the reason it was refused) for the op recorded at ``index``."""
    doc: dict[str, Any] = {"index": index, "inputs": inputs, "torch": torch.__version__}
    if isinstance(capture, str):
        doc["refused"] = capture
    else:
        torch.save(capture.tensors, request.tensors)
        doc.update(op=capture.op, args=capture.args, settings=capture.settings, tensors=_described(capture))
    atomic_write_json(request.call, doc)


def _described(capture: Snapshot) -> list[str]:
    return [f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}" for t in capture.tensors]


def _source(value: Any, tensors: list[torch.Tensor], copies: _Copies) -> str:
    """``value`` as Python source (a tensor: ``T[i]``, copied into ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(_copy(value, copies))
        return f"T[{len(tensors) - 1}]"
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, complex):
        return f"complex({_source(value.real, tensors, copies)}, {_source(value.imag, tensors, copies)})"
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)  # torch.float32, torch.strided, torch.contiguous_format
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, list):
        return "[" + ", ".join(_source(v, tensors, copies) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(_source(v, tensors, copies) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    raise Refused(f"an argument of type {type(value).__name__} cannot be written into a script")


def _copy(t: torch.Tensor, copies: _Copies) -> torch.Tensor:
    """A plain tensor with ``t``'s values, dtype, device, shape, strides and storage offset."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise Refused(f"a tensor argument is a {type(t).__name__}, not a plain tensor")
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
        raise Refused(f"a tensor argument has layout {t.layout} on {t.device} (strided tensors only)")
    if t.is_conj() or t.is_neg():
        raise Refused("a tensor argument is a lazy conjugate or negative view")
    storage = t.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes(), str(t.device))
    copy = copies.get(key)
    if copy is None:
        copy = copies[key] = storage.clone()  # type: ignore[no-untyped-call]
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(copy, t.storage_offset(), t.size(), t.stride())


def _settings(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """What decides the kernel besides the inputs, as this process has it."""
    settings: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "mkldnn": bool(torch.backends.mkldnn.enabled),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "env": {var: os.environ[var] for var in _PROCESS_START_VARS if os.environ.get(var)},
    }
    if any(t.device.type == "cuda" for t in tensors):
        settings.update(
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            cudnn_tf32=bool(torch.backends.cudnn.allow_tf32),
            cuda_matmul_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
        )
    return settings
