"""Placeholder: RNG state capture and restore."""

# ruff: noqa
from __future__ import annotations
from typing import Any


class RngState:
    """Placeholder."""


def fork_rng(seed: int | None = None) -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")
