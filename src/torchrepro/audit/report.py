"""The audit report of a run: every rule applied, the findings sorted, what was seen.

Invariants:
- ``report`` applies the table rules (TR001/TR002), the op rules, the thread rules (TR6xx, from
  the facts the recorder noted) and, when the probe wrote its record, the settings rules, keeps
  one finding per cause (code, op and location: ``findings.collapse``) and lists the findings by
  ``findings.sort_key``; it runs nothing.
- ``AuditReport.to_dict()`` is the object ``audit --json`` prints: ``findings`` (each with the
  keys of ``Finding.to_dict()``), ``script``, ``steps``, ``optimizer_steps``, ``ops_recorded``,
  ``torch_version``, ``table_release`` and ``settings`` (``ProbeSettings.to_dict()``, ``{}`` when
  the probe wrote nothing), then ``backward_steps``, ``training_steps``, ``training_processes``
  and ``processes`` (one summary per process). Keys are only ever added. The step counts are
  over every process the audit followed (the audited one and the python children it started);
  ``None`` when the probe wrote nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchrepro.audit.findings import Finding, collapse, sort_key
from torchrepro.audit.op_rules import as_event, audit_ops, table_findings
from torchrepro.audit.optable import load_table
from torchrepro.audit.settings import ProbeSettings
from torchrepro.audit.settings_rules import audit_settings, processes, steps_of
from torchrepro.audit.threads import audit_threads

__all__ = ["AuditReport", "report"]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The result of :func:`audit_script`: the findings, most severe first, and what was seen."""

    findings: tuple[Finding, ...]
    script: str
    steps: int
    optimizer_steps: int | None
    ops_recorded: int
    torch_version: str
    table_release: str
    settings: ProbeSettings | None
    backward_steps: int | None = None
    processes: tuple[Mapping[str, Any], ...] = ()

    @property
    def training_steps(self) -> int | None:
        """Optimizer steps and backward steps (where no optimizer steps) in every process followed."""
        if self.optimizer_steps is None:
            return None
        return self.optimizer_steps + (self.backward_steps or 0)

    @property
    def training_processes(self) -> int:
        """How many processes made a training step."""
        return sum(1 for p in self.processes if steps_of(p) > 0)

    @property
    def errors(self) -> tuple[Finding, ...]:
        """The findings of severity ``error``."""
        return tuple(f for f in self.findings if f.severity == "error")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: ``{"findings": [...], "script", "steps", ...}``."""
        return {
            "findings": [f.to_dict() for f in self.findings],
            "script": self.script,
            "steps": self.steps,
            "optimizer_steps": self.optimizer_steps,
            "ops_recorded": self.ops_recorded,
            "torch_version": self.torch_version,
            "table_release": self.table_release,
            "settings": self.settings.to_dict() if self.settings is not None else {},
            "backward_steps": self.backward_steps,
            "training_steps": self.training_steps,
            "training_processes": self.training_processes,
            "processes": [dict(p) for p in self.processes],
        }


def report(*, script: str, steps: int, events: Sequence[Any], settings: ProbeSettings | None) -> AuditReport:
    """The audit report of a run: table, op, thread and settings findings, one per code, op and
    location, most severe first (``settings`` None: the probe wrote nothing, and no setting is
    judged)."""
    calls = settings.calls if settings is not None else ()
    findings = table_findings() + audit_ops(events, calls=calls) + audit_threads(events)
    if settings is not None:
        findings += audit_settings(settings, events=events)
    steps_done = settings.optimizer_steps if settings is not None else None
    return AuditReport(
        backward_steps=settings.backward_steps if settings is not None else None,
        processes=tuple(processes(settings)) if settings is not None else (),
        findings=tuple(sorted(collapse(findings), key=sort_key)),
        script=script,
        steps=steps,
        optimizer_steps=steps_done if isinstance(steps_done, int) else None,
        ops_recorded=sum(as_event(e).count for e in events),
        torch_version=torch.__version__,
        table_release=load_table().release,
        settings=settings,
    )
