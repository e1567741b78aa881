"""Placeholder: audit."""

# ruff: noqa
from __future__ import annotations


class Finding:
    """Placeholder."""
