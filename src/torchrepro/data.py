"""Placeholder: seeded data loading."""

# ruff: noqa
from __future__ import annotations
from typing import Any


class SeededLoader:
    """Placeholder."""


def sample_rng() -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")
