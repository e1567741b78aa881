"""What a finding of the audit is, and the order a report lists findings in.

Invariants:
- ``Finding`` is the one shape of a finding; its ``to_dict()`` keys, in order, are those of
  ``audit --json`` (code, severity, op, module, location, message, fix). Codes are stable.
- Findings are listed most severe first, then by code, location and op (``sort_key``), so the
  same run gives the same report.
- Standard library only; every rule module imports this one, and it imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["SEVERITIES", "Finding", "settings_finding", "sort_key"]

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
    ``location`` (``file:line``) the user's code.

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
