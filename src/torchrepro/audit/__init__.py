"""Audit a training script for what would break bitwise determinism, on CUDA included, from a CPU run.

- Pure rules, no I/O: ``audit.optable`` (the op table ``ops_table.json``, by torch release),
  ``audit.op_rules`` (recorded ops -> findings), ``audit.threads`` (CPU ops whose result depends
  on the thread count: the facts the recorder notes, TR6xx), ``audit.settings_rules`` (one rule
  per settings finding code), ``audit.loader_rules`` (DataLoaders and seeds), ``audit.findings``
  (``Finding``, one finding per cause: code, op and location, the order of a report) and
  ``audit.report`` (``AuditReport``: every rule applied).
- ``audit.settings``: ``ProbeSettings``, what the child's probe saw, as the rules take it.
- ``audit.runner``: ``audit_script`` runs the script through the child bootstrap and applies them.
- The child-side probe is ``torchrepro._child.probe`` (``SettingsProbe``).

Submodules load lazily: importing ``torchrepro.audit`` imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro.audit.findings import Finding
    from torchrepro.audit.op_rules import audit_ops
    from torchrepro.audit.report import AuditReport
    from torchrepro.audit.runner import audit_script
    from torchrepro.audit.settings import ProbeSettings
    from torchrepro.audit.settings_rules import audit_settings

__all__ = ["AuditReport", "Finding", "ProbeSettings", "audit_ops", "audit_script", "audit_settings"]

_WHERE = {
    "AuditReport": "report",
    "Finding": "findings",
    "audit_ops": "op_rules",
    "audit_settings": "settings_rules",
    "audit_script": "runner",
    "ProbeSettings": "settings",
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, __all__)
