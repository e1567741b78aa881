"""The op rules: findings for the aten ops a run recorded, from the op table.

Invariants:
- ``audit_ops`` is a pure function of the recorded op events (``OpEvent`` objects or their
  dicts) and the Python-level calls the child's probe saw: testable without running anything.
- Conditions of the table (``bincount`` with weights, ``cumsum`` on floats...) are decided from
  the recorded arguments, else from the arguments of the Python-level call at the op's line; one
  it cannot decide never yields an error: the finding is a warning that says what is unknown.
- Findings for a backward op carry the module and source line of the forward call that created
  it (the recorder's location), never ``loss.backward()``.
- Ops that raise under strict mode on CUDA give one finding per op and call site, whatever the
  number of modules that ran it there (a line in a block's ``forward`` runs in every block):
  ``module`` names them all; ops that strict mode makes deterministic give one ``info`` per table
  entry, at the first site, naming the modules there; ops not in the table give nothing.
- ``table_findings``: the table is for another release (TR001), or lacks documented items (TR002).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from torchrepro.audit.findings import Finding, name_modules, sort_key
from torchrepro.audit.optable import Entry, OpSpec, load_table
from torchrepro.errors import TraceError

__all__ = ["as_event", "audit_ops", "table_findings"]


@dataclasses.dataclass(frozen=True)
class _Event:
    name: str  # "aten.cumsum"
    overload: str | None
    module: str | None
    location: str | None
    backward: bool
    count: int
    args: Sequence[Any] | None


def _field(event: Any, name: str, default: Any = None) -> Any:
    if isinstance(event, Mapping):
        return event.get(name, default)
    return getattr(event, name, default)


def as_event(event: Any) -> _Event:
    """A recorded op event (an ``OpEvent``, its dict, or an ``_Event``) as the rules read it."""
    if isinstance(event, _Event):
        return event
    op = _field(event, "op")
    if not isinstance(op, str) or not op:
        raise TraceError(f"An op event needs an 'op' name like 'aten.cumsum.default'; got {op!r}.")
    parts = str(op).split(".")
    if len(parts) >= 3:
        name, overload = ".".join(parts[:2]), ".".join(parts[2:])
    else:
        name, overload = op, None
    args = None
    for key in ("args", "arguments"):
        value = _field(event, key)
        if isinstance(value, (list, tuple)):
            args = value
            break
    count = _field(event, "count", 1)
    return _Event(
        name=name,
        overload=overload,
        module=_field(event, "module"),
        location=_field(event, "location"),
        backward=bool(_field(event, "backward", False)),
        count=count if isinstance(count, int) and count > 0 else 1,
        args=args,
    )


_UNKNOWN = object()


def _arg(event: _Event, index: int) -> Any:
    if event.args is None or index >= len(event.args):
        return _UNKNOWN
    return event.args[index]


def _tensor_attr(value: Any, attr: str) -> Any:
    """An attribute of a recorded tensor argument (a summary dict, or a tensor), else _UNKNOWN."""
    if isinstance(value, torch.Tensor):
        if attr == "dtype":
            return str(value.dtype)
        if attr == "quantized":
            return value.is_quantized
        if attr == "sparse":
            return value.layout != torch.strided
    if isinstance(value, Mapping) and attr in value:
        return value[attr]
    if isinstance(value, Mapping) and attr == "sparse" and "layout" in value:
        return value["layout"] != "torch.strided"
    return _UNKNOWN


def _is_float_or_complex(dtype: Any) -> bool | None:
    if not isinstance(dtype, str):
        return None
    name = dtype.removeprefix("torch.")
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        return None
    return d.is_floating_point or d.is_complex


def _condition_holds(cond: Mapping[str, Any], event: _Event) -> bool | None:
    """Whether the recorded call meets ``cond``; None when the recording cannot tell."""
    kind = cond["kind"]
    value = _arg(event, int(cond.get("arg", 0)))
    if value is _UNKNOWN:
        return None
    if kind == "reduction_not_none":
        return value != 0 if isinstance(value, int) else None
    if kind == "embedding_bag_max":
        return value == 2 if isinstance(value, int) else None
    if kind == "weights_given":
        return value is not None
    if kind == "reduce_in":
        return value in cond["values"] if isinstance(value, str) else None
    if kind == "floating_or_complex":
        return _is_float_or_complex(_tensor_attr(value, "dtype"))
    if kind in ("quantized", "sparse"):
        attr = _tensor_attr(value, kind)
        return bool(attr) if isinstance(attr, bool) else None
    return None


_FACT_OF_CONDITION = {
    "reduction_not_none": "reduction",
    "embedding_bag_max": "mode",
    "weights_given": "weights",
    "reduce_in": "reduce",
    "floating_or_complex": "floating",
}


def _fact_holds(cond: Mapping[str, Any], value: Any) -> bool | None:
    kind = cond["kind"]
    if kind == "reduction_not_none":
        return value != "none" if isinstance(value, str) else None
    if kind == "embedding_bag_max":
        return value == "max" if isinstance(value, str) else None
    if kind == "reduce_in":
        return value in cond["values"] if isinstance(value, str) else None
    return value if isinstance(value, bool) else None


def _condition_from_calls(
    cond: Mapping[str, Any], event: _Event, calls: Mapping[str | None, list[Mapping[str, Any]]]
) -> bool | None:
    """The condition decided from the Python-level calls the probe saw at the event's line."""
    fact = _FACT_OF_CONDITION.get(cond["kind"])
    if fact is None or event.location is None:
        return None
    verdicts = [_fact_holds(cond, c[fact]) for c in calls.get(event.location, ()) if fact in c]
    if not verdicts or None in verdicts:
        return None
    return any(verdicts)


_CONDITION_TEXT = {
    "reduction_not_none": "reduction is 'mean' or 'sum' (the default)",
    "embedding_bag_max": "mode='max'",
    "weights_given": "weights were given",
    "reduce_in": "reduce is {values}",
    "floating_or_complex": "the tensor is floating point or complex",
    "quantized": "the tensor is quantized",
    "sparse": "an input is sparse",
}


def _condition_text(cond: Mapping[str, Any]) -> str:
    return _CONDITION_TEXT[cond["kind"]].format(values=" or ".join(repr(v) for v in cond.get("values", ())))


def _matches(spec: OpSpec, event: _Event) -> bool:
    if spec.name != event.name:
        return False
    if spec.overload is not None and spec.overload != event.overload:
        return False
    return spec.phase == "any" or (spec.phase == "backward") == event.backward


def _op_message(entry: Entry, phases: set[bool], uncertain: bool, ops: Sequence[str], sites: int) -> str:
    where = ""
    if phases == {True}:
        where = " (recorded in backward; the location is its forward call)"
    elif phases == {True, False}:
        where = " (in forward and in backward; the location is the forward call)"
    source = f" ({entry.listed_in})" if entry.listed_in else ""
    if entry.section == "raises":
        device = {
            False: "on CUDA",
            True: "on any device, the CPU included",
            None: "on CUDA, nor on the CPU in some of the documented cases",
        }[entry.cpu]
        msg = (
            f"{entry.title}{where}: no deterministic implementation {device}{source}. There, strict mode "
            "(torch.use_deterministic_algorithms(True)) raises RuntimeError; without it the result can "
            "differ from run to run."
        )
        if uncertain:
            cond = entry.condition or {}
            msg += (
                f" This applies only if {_condition_text(cond)}, which the op recording cannot tell: "
                "check the call."
            )
        return msg
    if entry.section == "unguarded":
        msg = (
            f"{entry.title}{where}: strict mode (torch.use_deterministic_algorithms(True)) does not stop "
            f"{', '.join(ops)}, yet its result differs from run to run on CUDA{source}."
        )
        if uncertain:
            msg += f" Only if {_condition_text(entry.condition or {})}, which the op recording cannot tell."
        return msg
    why = entry.why or (
        "nondeterministic on CUDA (and on the CPU where the documentation says so) unless deterministic "
        "algorithms are on; strict mode makes it deterministic, at some speed cost"
    )
    msg = f"{entry.title}: {why}{source}. Ran as {', '.join(ops)}"
    msg += "." if sites <= 1 else f" at {sites} places; the first is shown."
    if uncertain:
        msg += f" Only if {_condition_text(entry.condition or {})}, which the op recording cannot tell."
    return msg


_PER_SITE = ("raises", "unguarded")  # sections reported per op and call site, as errors


@dataclasses.dataclass
class _Group:
    """The recorded calls one finding covers: its entry, the op and location it shows, and the
    modules that ran it there, whether each call's condition was unknown, the ops and sites."""

    entry: Entry
    op: str
    location: str | None
    modules: dict[str | None, None] = dataclasses.field(default_factory=dict)
    unsure: list[bool] = dataclasses.field(default_factory=list)
    ops: dict[str, None] = dataclasses.field(default_factory=dict)
    sites: set[tuple[str | None, bool]] = dataclasses.field(default_factory=set)


def audit_ops(events: Iterable[Any], *, calls: Iterable[Mapping[str, Any]] = ()) -> list[Finding]:
    """Findings for recorded op events (``OpEvent`` objects or their ``to_dict()`` dicts).

    ``calls`` are facts about Python-level calls (``{"fn", "location", "weights"|"floating"|
    "reduce"|"reduction"|"mode": ...}``, as the audited child's probe records them) that decide
    the conditions of the table for ops recorded at the same ``location``.

    Ops that raise under strict mode on CUDA, or that it does not stop although they stay
    nondeterministic (``unguarded``, measured), give one ``error`` per op
    and call site (a ``warning`` when a condition of the table cannot be checked from any of its
    calls), naming every module that ran it there; ops that strict mode makes deterministic give
    one ``info`` per table entry. Ops not in the table give nothing.

    >>> [f.code for f in audit_ops([{"op": "aten.relu.default", "module": "net.act",
    ...                               "location": "t.py:3", "backward": False}])]
    []
    """
    table = load_table()
    by_name: dict[str, list[tuple[Entry, OpSpec]]] = {}
    for entry in table.entries:
        for spec in entry.ops:
            by_name.setdefault(spec.name, []).append((entry, spec))
    by_location: dict[str | None, list[Mapping[str, Any]]] = {}
    for call in calls:
        by_location.setdefault(call.get("location"), []).append(call)
    groups: dict[tuple[Any, ...], _Group] = {}
    for raw in events:
        event = as_event(raw)
        for entry, spec in by_name.get(event.name, ()):
            if not _matches(spec, event):
                continue
            uncertain = False
            if entry.condition is not None:
                holds = _condition_holds(entry.condition, event)
                if holds is None:
                    holds = _condition_from_calls(entry.condition, event, by_location)
                if holds is False:
                    continue
                if holds is None:
                    if entry.condition.get("if_unknown") == "skip":
                        continue
                    uncertain = True
            op = event.name if event.overload in (None, "default") else f"{event.name}.{event.overload}"
            # the cause: an op at a line (every module that ran it there), or a table entry
            key: tuple[Any, ...] = (
                (entry.code, op, event.location) if entry.section in _PER_SITE else (entry.code,)
            )
            group = groups.setdefault(key, _Group(entry, op, event.location))
            group.unsure.append(uncertain)
            group.ops[op] = None
            group.sites.add((event.location, event.backward))
            if event.location == group.location:
                group.modules[event.module] = None
    findings = []
    for group in groups.values():
        entry = group.entry
        unsure = all(group.unsure)
        severity = ("warning" if unsure else "error") if entry.section in _PER_SITE else "info"
        sites = group.sites
        phases = {backward for _, backward in sites}
        findings.append(
            Finding(
                code=entry.code,
                severity=severity,
                op=group.op,
                module=name_modules(group.modules),
                location=group.location,
                message=_op_message(
                    entry, phases, unsure, list(group.ops), len({loc for loc, _ in group.sites})
                ),
                fix=entry.fix,
            )
        )
    return sorted(findings, key=sort_key)


def table_findings() -> list[Finding]:
    """TR001/TR002: this torch's documentation could not be read, or documents items the table lacks."""
    table = load_table()
    out = []
    if not table.read:
        out.append(
            Finding(
                "TR001",
                "info",
                None,
                None,
                None,
                f"torch {torch.__version__}'s use_deterministic_algorithms documentation could not be read, "
                f"so the op lists are {table.listed_in}"
                + ("." if table.exact else ": ops added or fixed since may be missed or reported wrongly."),
                "Upgrade torchrepro (torchrepro/audit/optable.py reads the documentation; "
                "tests/audit/test_audit_optable.py checks it against the installed torch).",
            )
        )
    new = list(table.uncovered)
    if new:
        out.append(
            Finding(
                "TR002",
                "warning",
                None,
                None,
                None,
                "torch.use_deterministic_algorithms documents ops the audit's table does not cover: "
                + "; ".join(new),
                "Check these ops in your script by hand, and add them to torchrepro/audit/ops_table.json.",
            )
        )
    return out
