"""Audit a training script for what would break bitwise determinism, on CUDA included, from a CPU run.

- ``audit.rules``: pure rules (the op table ``ops_table.json`` and the settings rules), no I/O.
- ``audit.runner``: ``audit_script`` runs the script through the child bootstrap and applies them.
- ``audit.settings``: ``ProbeSettings``, what the child's probe saw, as the rules take it.
- The child-side probe is ``torchrepro._child.probe`` (``SettingsProbe``).

Submodules load lazily: importing ``torchrepro.audit`` imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro.audit.rules import AuditReport, Finding, audit_ops, audit_settings
    from torchrepro.audit.runner import audit_script
    from torchrepro.audit.settings import ProbeSettings

__all__ = ["AuditReport", "Finding", "ProbeSettings", "audit_ops", "audit_script", "audit_settings"]

_WHERE = {
    "AuditReport": "rules",
    "Finding": "rules",
    "audit_ops": "rules",
    "audit_settings": "rules",
    "audit_script": "runner",
    "ProbeSettings": "settings",
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, __all__)
