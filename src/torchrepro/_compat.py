"""Optional dependencies and version differences, in one place.

Invariant: NumPy is imported only if it is installed; nothing here imports anything else optional.
torch is imported only inside the functions that need it (the CLI's parent path imports this module
without torch).
"""

from __future__ import annotations

import importlib.util
import weakref
from collections.abc import MutableSet
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


class _LazyModule(ModuleType):
    """A module imported on first attribute access (for code on the CLI's torch-free path)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self.__dict__.get("_module")
        if module is None:
            module = importlib.import_module(self.__name__)
            self.__dict__["_module"] = module
        return getattr(module, attr)


def lazy_import(name: str) -> Any:
    """``name``'s module, imported when an attribute is first read (so importing the caller does
    not import it). Modules on the command line's parent path use this for torch: the parent
    process parses arguments and starts the child without paying for ``import torch``."""
    return _LazyModule(name)


def generator_set() -> MutableSet[Any]:
    """An empty set of ``torch.Generator`` objects that does not keep them alive, where torch allows.

    Where torch's generators take no weak references (torch 2.4), the set holds them: each stays
    alive as long as the set (one small object per SeededLoader).
    """
    import torch

    try:
        weakref.ref(torch.Generator())
    except TypeError:
        return set()
    return weakref.WeakSet()
