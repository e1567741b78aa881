"""Comparing two trace files: the first op at which two runs part, and why.

Invariants:
- Reads trace files only: imports neither torch nor its dispatch internals.
- Ops are aligned by their order, separately per lane (the traced thread; every other thread); the
  op reported is where the difference enters, not a victim downstream.
- A missing, unreadable or malformed file, or another format version, raises ``TraceError``; so do
  two traces whose digests were computed with different algorithms (their values cannot be
  compared: every op would look different).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Final

from torchrepro.errors import TraceError
from torchrepro.tracing.ops import (
    COLLECTIVE_NAMESPACES,
    FORMAT,
    FORMAT_VERSION,
    LEGACY_DIGEST,
    OpDivergence,
)

_RANDOM_OPS: Final = (
    "bernoulli",
    "dropout",
    "normal",
    "uniform",
    "rand",
    "multinomial",
    "exponential",
    "geometric",
    "log_normal",
    "cauchy",
    "random_",
)


def draws_randomness(op: str) -> bool:
    """Whether ``op`` (``aten.native_dropout.default``) draws from a random number generator, by name."""
    return any(r in op for r in _RANDOM_OPS)


# --------------------------------------------------------------------------------------------
# Comparing traces
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Record:
    op: str
    module: str | None
    location: str | None
    backward: bool
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    index: int  # position in its trace
    lane: int  # 0: the thread that started the tracer; 1: any other thread


@dataclasses.dataclass(frozen=True)
class _Trace:
    path: str
    rank: int | None
    records: tuple[_Record, ...]
    digest: str  # the algorithm of its value digests


def load_trace(path: str | os.PathLike[str]) -> _Trace:
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise TraceError(
            f"Op trace {where} does not exist; write one with torchrepro.trace({where!r})."
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"Op trace {where} is unreadable: {exc}.") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceError(f"{where} is not a torchrepro op trace (expected format {FORMAT!r}).")
    if doc.get("version") != FORMAT_VERSION:
        raise TraceError(
            f"Op trace {where} has format version {doc.get('version')!r}; this torchrepro reads version "
            f"{FORMAT_VERSION}. Record both traces with the same torchrepro version."
        )
    try:
        ops, sites, values = doc["ops"], doc["sites"], doc["values"]
        records = tuple(
            _Record(
                op=ops[op],
                module=sites[site][0],
                location=sites[site][1],
                backward=bool(backward),
                inputs=tuple(values[i] for i in ins),
                outputs=tuple(values[i] for i in outs),
                index=index,
                lane=int(rest[0]) if rest else 0,
            )
            for index, (op, site, backward, ins, outs, *rest) in enumerate(doc["records"])
        )
        rank = doc.get("rank")
        digest = str(doc.get("digest", LEGACY_DIGEST))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise TraceError(f"Op trace {where} is malformed ({type(exc).__name__}: {exc}).") from None
    return _Trace(where, rank if isinstance(rank, int) else None, records, digest)


def _describe_input(index: int, a: str, b: str) -> str:
    if a.startswith("s:") and b.startswith("s:"):
        return f"its non-tensor arguments differ ({a[2:]} vs {b[2:]})"
    if a.startswith("s") and b.startswith("s"):
        return "its non-tensor arguments differ"
    return f"tensor input {index} differs"


def compare_traces(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> OpDivergence | None:
    """The first op at which traces ``a`` and ``b`` part, or ``None`` when every op matches.

    Ops are aligned by their order. The first op whose outputs differ is where the difference
    enters: every earlier op produced bitwise-equal outputs, so its inputs are equal too unless a
    value came from outside the traced ops (a Python scalar, a tensor made from Python data, a write
    the tracer did not see); ``inputs_equal`` and ``note`` say which. When the two runs issued
    different ops before any output differed, that op is reported with ``structural=True``.
    Ops that ran on other threads than the traced one (callbacks of collectives) are aligned among
    themselves, since their interleaving with the traced thread varies from run to run.
    Raises ``TraceError`` for a missing or malformed file, and for two traces whose values were
    digested with different algorithms (written by torchrepro versions that hash differently).
    """
    ta, tb = load_trace(a), load_trace(b)
    if ta.digest != tb.digest:
        raise TraceError(
            f"Op traces {ta.path} and {tb.path} cannot be compared: their values were digested with "
            f"different algorithms ({ta.digest} and {tb.digest}), so every op would look different. "
            "Record both traces with the same torchrepro version."
        )
    found = []
    for lane in sorted({r.lane for r in ta.records} | {r.lane for r in tb.records}):
        d = _compare_lane(ta, tb, lane)
        if d is not None:
            found.append(d)
    return min(found, key=lambda d: d.index) if found else None


def _compare_lane(ta: _Trace, tb: _Trace, lane: int) -> OpDivergence | None:
    la = [r for r in ta.records if r.lane == lane]
    lb = [r for r in tb.records if r.lane == lane]
    for ra, rb in zip(la, lb, strict=False):
        if ra.op != rb.op or len(ra.inputs) != len(rb.inputs) or len(ra.outputs) != len(rb.outputs):
            where_b = f"{rb.op} ({rb.module or 'no module'}, {rb.location or 'unknown line'})"
            return OpDivergence(
                op=ra.op,
                module=ra.module,
                location=ra.location,
                backward=ra.backward,
                index=ra.index,
                inputs_equal=ra.inputs == rb.inputs,
                structural=True,
                other_op=rb.op,
                rank=ta.rank,
                note=(
                    f"the runs issued different ops at op {ra.index} before any output differed: {ra.op} "
                    f"here, {where_b} in the other run. Control flow parted in Python (a branch on the "
                    "time, a process id, set or dict order, the environment)."
                ),
            )
        if ra.outputs != rb.outputs:
            return _divergence(ra, rb, ta.rank)
    if len(la) == len(lb):
        return None
    n = min(len(la), len(lb))
    longer, shorter, extra = (ta, tb, la[n]) if len(la) > len(lb) else (tb, ta, lb[n])
    return OpDivergence(
        op=extra.op,
        module=extra.module,
        location=extra.location,
        backward=extra.backward,
        index=la[n].index if len(la) > n else len(ta.records),
        inputs_equal=False,
        structural=True,
        other_op=None,
        rank=ta.rank,
        note=(
            f"{shorter.path} ends after {n} equal ops; {longer.path} goes on with {extra.op}. "
            "Control flow parted in Python, or one trace was stopped early."
        ),
    )


def _divergence(ra: _Record, rb: _Record, rank: int | None) -> OpDivergence:
    differing = [j for j, (x, y) in enumerate(zip(ra.inputs, rb.inputs, strict=True)) if x != y]
    outs = [j for j, (x, y) in enumerate(zip(ra.outputs, rb.outputs, strict=True)) if x != y]
    what = f"output {outs[0]}" if len(ra.outputs) > 1 else "its output"
    if not differing:
        cause = (
            "it draws from a random number generator whose state differs between the runs"
            if draws_randomness(ra.op)
            else "the op is nondeterministic here, or reads state the tracer cannot see"
        )
        note = f"every input is bitwise equal but {what} differs: {cause}."
    else:
        reasons = "; ".join(_describe_input(j, ra.inputs[j], rb.inputs[j]) for j in differing[:3])
        note = (
            f"{what} differs and {reasons}, although every earlier op matched: the value comes from "
            "outside the traced ops (Python data such as a process id or the time, a tensor built from "
            "it, or a write the tracer did not see)."
        )
    if ra.op.startswith(COLLECTIVE_NAMESPACES):
        note += (
            " This is a collective: its result also depends on the other ranks, so the source is "
            "likely on another rank; compare their traces."
        )
    return OpDivergence(
        op=ra.op,
        module=ra.module,
        location=ra.location,
        backward=ra.backward,
        index=ra.index,
        inputs_equal=not differing,
        rank=rank,
        note=note,
    )
