"""Placeholder: environment fingerprint."""

# ruff: noqa
from __future__ import annotations
from typing import Any


class Environment:
    """Placeholder."""


class EnvDifference:
    """Placeholder."""


def collect_env() -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")


def diff_env(a: Any, b: Any) -> Any:
    """Placeholder."""
    raise NotImplementedError("under construction")
