"""Placeholder: launcher."""

# ruff: noqa
from __future__ import annotations
from typing import Any


def relaunch(seed: int = 0, mode: str = "strict") -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")
