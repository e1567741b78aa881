"""CPU ops whose result depends on the thread count, even in portable mode (``TR6xx``).

Invariants:
- Only what was measured is listed (torch 2.13.0 CPU, 1 vs 2 threads, ``MKL_CBWR=AVX2,STRICT``
  and oneDNN off, on x86 with AVX2 and AVX-512 kernels): each entry's condition is the one under
  which the bits differed, and its fix was measured equal at 1 and 2 threads. Ops measured
  thread-invariant there (GEMMs, convolution without oneDNN, softmax, ``cross_entropy``, GroupNorm,
  RMSNorm, contiguous BatchNorm2d, attention, ``norm``/``var``, sums over a dim with several
  outputs, ``scatter_add``/``index_add``/``bincount``/embedding backward) are not.
- ``facts`` runs in the audited child, inside the op recorder, on every op: it only reads tensor
  metadata, looks an op up in one dict, and never calls an op. ``audit_threads`` is a pure function
  of the recorded events, one finding per op and line (the modules that ran it there named in one);
  ``thread_entry``/``portable_removes`` name an op for ``check``'s notes.
- Imports no torch: ``check`` (the command line's parent) reads the table too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from torchrepro.audit.findings import Finding, name_modules, sort_key

__all__ = ["ENTRIES", "ThreadEntry", "audit_threads", "facts", "portable_removes", "thread_entry"]

GRAIN = 32768
"""ATen's parallel grain (``at::internal::GRAIN_SIZE``): a reduction to one value of more elements
is split into one partial sum per thread (measured: 32768 elements equal, 32769 differ)."""

DOT_THREADED = 8192
"""oneMKL's dot products split across threads from this length on (measured: 4096 equal, 8192
differ); strict CNR covers only its GEMM family, not these."""

_MEASURED = "measured on torch 2.13.0 CPU between 1 and 2 threads, with and without --portable"


@dataclasses.dataclass(frozen=True)
class ThreadEntry:
    """One kind of op whose CPU kernel splits work by thread: code, what, the ops, the fix."""

    code: str
    title: str
    ops: tuple[str, ...]  # aten op packets: "aten.sum"
    what: str  # what the kernel computes as one partial result per thread
    fix: str
    condition: Callable[[str, tuple[Any, ...], Any], str | None]


def _tensor(value: Any) -> Any:
    """``value`` if it is a tensor (anything with ``numel``/``dim``/``is_floating_point``), else None."""
    return value if hasattr(value, "numel") and hasattr(value, "is_floating_point") else None


def _to_one_value(op: str, args: tuple[Any, ...], out: Any) -> str | None:
    source, result = _tensor(args[0]) if args else None, _tensor(out)
    if source is None or result is None or result.numel() != 1 or not source.is_floating_point():
        return None
    n = source.numel()
    return f"{n} elements reduced to one value" if n > GRAIN else None


def _layer_norm_backward(op: str, args: tuple[Any, ...], out: Any) -> str | None:
    # (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask)
    if len(args) < 8:
        return None
    source, shape, mask = _tensor(args[1]), args[2], args[7]
    if source is None or not isinstance(mask, (list, tuple)) or not (mask[1] or mask[2]):
        return None
    size = 1
    for d in shape:
        size *= int(d)
    rows = source.numel() // max(size, 1)
    return f"weight/bias gradients summed over {rows} rows" if rows >= 2 else None


def _batch_norm(op: str, args: tuple[Any, ...], out: Any) -> str | None:
    # native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    # native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
    #                            save_invstd, train, eps, output_mask)
    backward = op.startswith("aten.native_batch_norm_backward")
    index, training = (1, 7) if backward else (0, 5)
    if len(args) <= training or args[training] is not True:
        return None
    source = _tensor(args[index])
    if source is None or source.dim() < 2 or source.size(0) < 2:
        return None
    if source.dim() == 2:
        return f"batch statistics of a ({source.size(0)}, {source.size(1)}) input"
    if source.dim() == 4 and not source.is_contiguous():
        import torch

        if source.is_contiguous(memory_format=torch.channels_last):
            return "batch statistics of a channels-last input"
    return None


def _dot(op: str, args: tuple[Any, ...], out: Any) -> str | None:
    source = _tensor(args[0]) if args else None
    if source is None or not source.is_floating_point() or source.numel() < DOT_THREADED:
        return None
    return f"a dot product of {source.numel()} elements"


ENTRIES = (
    ThreadEntry(
        "TR601",
        "A reduction of a whole tensor to one value",
        (
            "aten.sum",
            "aten.mean",
            "aten.prod",
            "aten.nansum",
            "aten.mse_loss",
            "aten.smooth_l1_loss",
            "aten.huber_loss",
            "aten.binary_cross_entropy",
            "aten.binary_cross_entropy_with_logits",
        ),
        f"the reduction of more than {GRAIN} floating-point elements to one value (a sum, a mean, a "
        "loss with reduction='mean' or 'sum')",
        "Pin the thread count (torchrepro run --threads N) so every run splits it alike, or reduce in "
        "two stages whose parts do not depend on it: x.reshape(k, -1).sum(1).sum() (k rows, each "
        "reduced by one thread, then k values; likewise .mean(1).mean(), and reduction='none' "
        "followed by that for a loss).",
        _to_one_value,
    ),
    ThreadEntry(
        "TR602",
        "LayerNorm backward (weight and bias gradients)",
        ("aten.native_layer_norm_backward",),
        "the weight and bias gradients, sums over the rows (the input gradient does not depend on it)",
        "Pin the thread count (torchrepro run --threads N), or apply the affine part outside the fused "
        "op: F.layer_norm(x, shape) * weight + bias (nn.LayerNorm(shape, elementwise_affine=False) "
        "and your own parameters): its gradients are then sums over a dim with several outputs, "
        "which do not depend on the thread count.",
        _layer_norm_backward,
    ),
    ThreadEntry(
        "TR603",
        "BatchNorm in training on a (N, C) or channels-last input",
        ("aten.native_batch_norm", "aten.native_batch_norm_backward"),
        "the batch statistics and the weight gradient, sums over the batch (in forward and backward; "
        "a contiguous (N, C, L) or (N, C, H, W) input is summed per channel instead)",
        "Pin the thread count (torchrepro run --threads N), or give BatchNorm a contiguous input: "
        "bn(x.t().unsqueeze(0).contiguous()).squeeze(0).t() for a (N, C) input (the same statistics "
        "over the N rows), x.contiguous() for a channels-last one.",
        _batch_norm,
    ),
    ThreadEntry(
        "TR604",
        "A long dot product",
        ("aten.dot", "aten.vdot"),
        f"a dot product of {DOT_THREADED} or more elements (oneMKL's level-1 BLAS, which its strict "
        "reproducibility mode does not cover)",
        "Pin the thread count (torchrepro run --threads N), or write it as a matrix product, which "
        "--portable makes independent of the thread count: a.view(1, -1) @ b.view(-1, 1).",
        _dot,
    ),
)
"""The measured table, one entry per finding code."""

_BY_OP = {op: entry for entry in ENTRIES for op in entry.ops}

_PORTABLE_REMOVES = {
    "aten.convolution_backward": "oneDNN's convolution backward splits its reductions by thread; "
    "--portable turns oneDNN off",
    "aten.mm": "oneMKL's GEMM splits its work by thread; --portable turns its strict reproducibility "
    "on (MKL_CBWR)",
}
_PORTABLE_REMOVES["aten.addmm"] = _PORTABLE_REMOVES["aten.bmm"] = _PORTABLE_REMOVES["aten.mm"]


def _packet(op: str) -> str:
    """``aten.sum.dim_IntList`` -> ``aten.sum`` (a name of two parts is already a packet)."""
    parts = op.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else op


_ENTRY_OF: dict[str, ThreadEntry | None] = {}
"""Op overload name -> its entry (None: not in the table), filled as ops are met."""


def facts(op: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> str | None:
    """Why this call's CPU result depends on the thread count (``OpRecorder``'s ``facts``), else None."""
    if op in _ENTRY_OF:
        entry = _ENTRY_OF[op]
    else:
        entry = _ENTRY_OF[op] = _BY_OP.get(_packet(op))
    if entry is None:
        return None
    try:
        return entry.condition(op, args, out)
    except Exception:  # an unexpected signature: say nothing rather than break the audited run
        return None


def thread_entry(op: str | None) -> ThreadEntry | None:
    """The entry of the table that ``op`` (``aten.native_layer_norm_backward.default``) falls under."""
    return None if not op else _BY_OP.get(_packet(op))


def portable_removes(op: str | None) -> str | None:
    """Why ``op``'s thread dependence is one that ``--portable`` removes (measured), else None."""
    return None if not op else _PORTABLE_REMOVES.get(_packet(op))


_Modules = dict[str | None, None]  # the modules that ran an op at a line, in first-seen order


def audit_threads(events: Iterable[Any]) -> list[Finding]:
    """One ``info`` finding per op and call site whose recorded calls have a thread fact, naming
    every module that ran it there (``findings.name_modules``).

    >>> [f.code for f in audit_threads([{"op": "aten.sum.default", "module": None, "location": "t.py:3",
    ...     "backward": False, "facts": ["131072 elements reduced to one value"]}])]
    ['TR601']
    """
    from torchrepro.audit.op_rules import as_event

    # the cause: an op at a line, whatever the number of modules that ran it there
    sites: dict[
        tuple[str, str, str | None], tuple[ThreadEntry, list[str], set[bool], dict[str | None, None]]
    ] = {}
    for raw in events:
        noted = raw.get("facts") if isinstance(raw, dict) else getattr(raw, "facts", ())
        if not noted:
            continue
        event = as_event(raw)
        entry = _BY_OP.get(event.name)
        if entry is None:
            continue
        op = event.name if event.overload in (None, "default") else f"{event.name}.{event.overload}"
        key = (entry.code, op, event.location)
        _, seen, phases, modules = sites.setdefault(key, (entry, [], set(), {}))
        seen.extend(f for f in noted if isinstance(f, str) and f not in seen)
        phases.add(event.backward)
        modules[event.module] = None
    findings = []
    for (code, op, location), (entry, seen, phases, modules) in sites.items():
        where = " (in backward; the location is its forward call)" if phases == {True} else ""
        message = (
            f"{entry.title}{where}: its CPU kernel computes {entry.what} as one partial result per "
            f"thread, so the result changes with the thread count, also under --portable ({_MEASURED}); "
            f"the same thread count gives the same bits. Here: {'; '.join(seen[:3])}."
        )
        findings.append(Finding(code, "info", op, name_modules(modules), location, message, entry.fix))
    return sorted(findings, key=sort_key)
