"""Placeholder: determinism switches (owned by the foundation work)."""

# ruff: noqa
from __future__ import annotations
from typing import Any


class DeterminismFlags:
    """Placeholder."""


class StatusReport:
    """Placeholder."""


def set_determinism(mode: str = "strict") -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")


def reproducible(seed: int, mode: str = "strict") -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")


def status() -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")
