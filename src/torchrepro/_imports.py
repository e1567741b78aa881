"""Run a function once a module has been imported, without importing it (a post-import hook).

Invariants:
- ``when_imported(name, fn)`` calls ``fn(module)`` at once when ``name`` is already in
  ``sys.modules``; otherwise right after the module's code has run, when something imports it,
  and only then: nothing here imports ``name`` or its parents.
- One finder on ``sys.meta_path`` serves every hook; it finds nothing itself (it asks the finders
  after it and wraps the loader they return), so an import behaves as it would without it. A
  callback that raises is reported on stderr and never breaks the import.
- Imports only the standard library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_waiting: dict[str, list[Callback]] = {}


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once module ``name`` is imported (now, if it already is)."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _waiting.setdefault(name, []).append(callback)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
            return
    _call(name, callback, module)


def _call(name: str, callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:  # a hook never breaks the script's import
        print(f"torchrepro: a hook on importing {name} failed: {exc!r}", file=sys.stderr)


def _ran(name: str) -> None:
    with _lock:
        callbacks = _waiting.pop(name, [])
    module = sys.modules.get(name)
    if module is not None:
        for callback in callbacks:
            _call(name, callback, module)


class _Loader(importlib.abc.Loader):
    """The loader another finder returned, and the hooks of ``name`` after it ran the module."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader  # the module sees the loader it would have had
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _ran(self._name)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        with _lock:
            if fullname not in _waiting:
                return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _Finder):
                continue
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None
