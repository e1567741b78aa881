"""Optional dependencies and version differences, in one place.

Invariant: NumPy is imported only if it is installed; nothing here imports anything else optional.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Any


def numpy_or_none() -> ModuleType | None:
    """Return the ``numpy`` module if it is installed, else ``None`` (imported on first use)."""
    global _numpy
    if _numpy is _UNSET:
        _numpy = None
        if importlib.util.find_spec("numpy") is not None:
            import numpy

            _numpy = numpy
    return _numpy  # type: ignore[no-any-return]


def require_numpy(feature: str) -> Any:
    """Return ``numpy`` or raise an ImportError naming the install command for ``feature``."""
    np = numpy_or_none()
    if np is None:
        raise ImportError(
            f"{feature} needs NumPy, which is not installed. "
            "Install it with `pip install torchrepro[numpy]` (or `pip install numpy`)."
        )
    return np


_UNSET: Any = object()
_numpy: Any = _UNSET
