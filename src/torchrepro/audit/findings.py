"""What a finding of the audit is, and the order a report lists findings in.

Invariants:
- ``Finding`` is the one shape of a finding; its ``to_dict()`` keys, in order, are those of
  ``audit --json`` (code, severity, op, module, location, message, fix). Codes are stable.
- Findings are listed most severe first, then by code, location and op (``sort_key``), so the
  same run gives the same report.
- One finding per cause: a report holds at most one finding per code, op and location
  (``collapse``); the modules of the calls it covers are named in its one ``module`` string
  (``name_modules``: ``blocks.[0-11].norm1 (12 modules)``).
- Standard library only; every rule module imports this one, and it imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["SEVERITIES", "Finding", "collapse", "name_modules", "settings_finding", "sort_key"]

SEVERITIES = ("error", "warning", "info")
_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing that breaks (or may break) bitwise reproducibility, with where and how to fix it.

    ``code`` is stable (``TR1xx`` ops, ``TR2xx`` settings, ``TR3xx`` data loading and seeds,
    ``TR4xx`` compilation, ``TR5xx`` processes, ``TR6xx`` CPU results that change with the
    thread count, ``TR0xx`` about the audit itself); ``severity``
    is ``error`` (raises under strict mode on CUDA, or stays nondeterministic whatever the
    switches), ``warning`` or ``info``; ``op`` the aten op (or None); ``module`` and
    ``location`` (``file:line``) the user's code: ``module`` names every module whose calls
    the finding covers (one path, or :func:`name_modules`'s short form of several).

    >>> Finding("TR107", "error", "aten.reflection_pad2d_backward", "net.pad", "train.py:12",
    ...         "ReflectionPad2d backward ...", "Use replication padding").to_dict()["location"]
    'train.py:12'
    """

    code: str
    severity: str
    op: str | None
    module: str | None
    location: str | None
    message: str
    fix: str

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        """The finding as a JSON-able dict with the keys of ``audit --json``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Finding:
        """Inverse of :meth:`to_dict`."""
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def sort_key(f: Finding) -> tuple[int, str, str, str]:
    """Most severe first, then by code, location and op."""
    return (_SEVERITY_RANK[f.severity], f.code, f.location or "", f.op or "")


def settings_finding(
    code: str, severity: str, message: str, fix: str, location: str | None = None
) -> Finding:
    """A finding about a setting (no op, no module; the location when a line is known)."""
    return Finding(code, severity, None, None, location, message, fix)


def _index(part: str) -> int | None:
    """A path component that is a list index (``"3"``, not ``"03"`` nor ``"layer3"``), else None."""
    return int(part) if part.isdigit() and str(int(part)) == part else None


def _ranges(values: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, i) if (i := _index(p)) is not None else (1, p) for p in name.split("."))


def _fold(shape: tuple[str | None, ...], indices: Sequence[tuple[int, ...]]) -> list[str]:
    """The paths of one shape (``blocks.#.norm1``) with their index tuples folded into ranges:
    every slot as a range when the tuples are all its combinations, else the last slot only."""
    slots: list[list[int]] = [sorted({t[k] for t in indices}) for k in range(len(indices[0]))]
    combinations = 1
    for values in slots:
        combinations *= len(values)
    if combinations != len(set(indices)):  # not a full grid: fold the last slot per prefix
        prefixes: dict[tuple[int, ...], list[int]] = {}
        for t in sorted(set(indices)):
            prefixes.setdefault(t[:-1], []).append(t[-1])
        return [_fill(shape, [*map(str, prefix), _bracket(last)]) for prefix, last in prefixes.items()]
    return [_fill(shape, [_bracket(values) for values in slots])]


def _bracket(values: Sequence[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"[{_ranges(values)}]"


def _fill(shape: tuple[str | None, ...], texts: Sequence[str]) -> str:
    it = iter(texts)
    return ".".join(part if part is not None else next(it) for part in shape)


def name_modules(modules: Iterable[str | None]) -> str | None:
    """The modules of one finding as one string that names every one of them, or None when no
    call was in a module: a path alone, several joined, list indices folded into ranges
    (``blocks.0.norm1`` ... ``blocks.11.norm1`` -> ``blocks.[0-11].norm1``), and how many
    there are; calls outside any module among them are said last.

    >>> name_modules([f"blocks.{i}.norm{j}" for i in range(12) for j in (1, 2)] + ["norm"])
    'blocks.[0-11].norm1, blocks.[0-11].norm2, norm (25 modules)'
    >>> name_modules(["layers.0.attn", "layers.2.attn", "layers.3.attn", "head"])
    'head, layers.[0,2-3].attn (4 modules)'
    >>> name_modules(["net.pool", None, "net.pool"]), name_modules([None]), name_modules([])
    ('net.pool; also outside any module', None, None)
    """
    names = list(dict.fromkeys(modules))
    named = sorted((m for m in names if m is not None), key=_natural)
    if not named:
        return None
    shapes: dict[tuple[str | None, ...], list[tuple[int, ...]]] = {}
    for name in named:
        parts = name.split(".")
        shape = tuple(None if _index(p) is not None else p for p in parts)
        shapes.setdefault(shape, []).append(tuple(i for p in parts if (i := _index(p)) is not None))
    texts = [
        text
        for shape, indices in shapes.items()
        for text in ([_fill(shape, [])] if not indices[0] else _fold(shape, indices))
    ]
    text = ", ".join(texts) + (f" ({len(named)} modules)" if len(named) > 1 else "")
    return text + ("; also outside any module" if len(named) < len(names) else "")


def collapse(findings: Iterable[Finding]) -> list[Finding]:
    """One finding per cause: findings of the same code, op and location merged into one, in the
    order their first one came.

    The merged finding has the group's highest severity, the message and fix of its first finding
    of that severity (the other distinct messages follow it, after "Also here:"), and ``module``
    naming every module of the group (:func:`name_modules`). Rules group their own findings this
    way already, with their own wording (the op rules and the thread rules by module, the loader
    rules by loader); this is what keeps the report's promise for every code.

    >>> a = Finding("TR602", "info", "aten.native_layer_norm_backward", "blocks.0.norm1", "m.py:9", "m", "f")
    >>> [f.module for f in collapse([a, dataclasses.replace(a, module="blocks.1.norm1")])]
    ['blocks.[0-1].norm1 (2 modules)']
    """
    groups: dict[tuple[str, str | None, str | None], list[Finding]] = {}
    for f in findings:
        groups.setdefault((f.code, f.op, f.location), []).append(f)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        top = min(group, key=lambda f: _SEVERITY_RANK[f.severity])
        messages = list(dict.fromkeys(f.message for f in group if f.message != top.message))
        fixes = list(dict.fromkeys(f.fix for f in group if f.fix != top.fix))
        modules = list(dict.fromkeys(f.module for f in group))
        out.append(
            dataclasses.replace(
                top,
                module=modules[0] if len(modules) == 1 else name_modules(modules),
                message=" Also here: ".join([top.message, *messages]),
                fix=" ".join([top.fix, *fixes]),
            )
        )
    return out
