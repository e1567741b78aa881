"""Placeholder: run records."""

# ruff: noqa
from __future__ import annotations
from typing import Any


def record(name: str, value: Any) -> None:
    """Placeholder."""
    raise NotImplementedError("under construction")
