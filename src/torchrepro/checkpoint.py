"""Placeholder: checkpoints."""

# ruff: noqa
from __future__ import annotations
from typing import Any


def save_checkpoint(path: Any, **objects: Any) -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")


def load_checkpoint(path: Any, **objects: Any) -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")


def latest_checkpoint(directory: Any) -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")
