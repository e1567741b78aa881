"""A training function as a script: what a check of a function runs in its fresh processes.

Invariants:
- A function is named by its module and qualified name, never pickled: a lambda, a function
  defined inside another, a bound method or a function of ``__main__`` is refused with a
  ``TypeError`` saying why (the fresh processes could not import it).
- Its arguments travel as JSON and must arrive unchanged (``json.loads(json.dumps(v)) == v``):
  numbers, strings, booleans, None, lists and dicts with string keys; a path (``os.PathLike``)
  as an argument of its own arrives as a ``pathlib.Path``. Anything else is a ``TypeError``
  naming the argument, before anything starts.
- The runner script is standalone (standard library only; ``python runner.py`` calls the function
  without torchrepro) and puts the function's import root, then the calling process's
  ``sys.path`` in its order, first on its own ``sys.path``, so it imports what the caller would; a
  module that cannot be imported by its name (pytest's ``importlib`` import mode) is loaded from
  its file.
- Standard library only: no torch in the process that asks for a check.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["FunctionCall", "function_call", "write_runner"]

RUNNER_NAME = "torchrepro_runner.py"
LATER = "--later"
"""The runner's argument that adds the call's ``later_kwargs``."""


@dataclass(frozen=True)
class FunctionCall:
    """What the runner imports and calls: ``module``, ``qualname`` (``Class.method`` of a class
    whose instances need no arguments: a pytest test class), its ``file`` and import ``root``, and
    the arguments encoded as ``[kind, value]`` (``json`` or ``path``). ``later_kwargs``: keyword
    arguments the runner adds when started with ``--later`` (the later runs of a check that
    compares a variant of the call against it)."""

    module: str
    qualname: str
    file: str | None
    root: str | None
    args: tuple[tuple[str, Any], ...]
    kwargs: tuple[tuple[str, tuple[str, Any]], ...]
    later_kwargs: tuple[tuple[str, tuple[str, Any]], ...] = ()

    def with_later(self, kwargs: Mapping[str, Any]) -> FunctionCall:
        """This call, and for the later runs of a check the same call with ``kwargs`` added."""
        if not kwargs or not all(isinstance(k, str) for k in kwargs):
            raise TypeError(f"a variant of a call is a non-empty dict of keyword arguments, got {kwargs!r}")
        encoded = tuple((key, _encode(value, f"argument {key!r}")) for key, value in kwargs.items())
        return replace(self, later_kwargs=encoded)

    def describe(self) -> str:
        """``pkg.mod.train(3, lr=0.1)``: the call, as a person reads it."""
        shown = [_shown(kind, value) for kind, value in self.args]
        shown += [f"{name}={_shown(kind, value)}" for name, (kind, value) in self.kwargs]
        text = ", ".join(shown)
        return f"{self.module}.{self.qualname}({text if len(text) <= 60 else text[:57] + '...'})"


def _shown(kind: str, value: Any) -> str:
    return f"Path({value!r})" if kind == "path" else repr(value)


def function_call(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    methods: bool = False,
) -> FunctionCall:
    """``function(*args, **kwargs)`` as a call the runner can make in a fresh process.

    ``methods``: a ``Class.method`` qualified name is called on a new ``Class()`` (how pytest runs
    a test method); otherwise only module-level functions and static methods are accepted.
    Raises ``TypeError`` for a function the fresh processes cannot import, or an argument that
    cannot travel unchanged.
    """
    name = getattr(function, "__qualname__", None)
    module_name = getattr(function, "__module__", None)
    if inspect.ismethod(function) and not inspect.isclass(function.__self__):
        raise TypeError(
            f"{name} is a bound method: its instance cannot be sent to the fresh processes a check "
            "runs; pass a module-level function that builds what it needs"
        )
    if not callable(function) or not isinstance(name, str) or not isinstance(module_name, str):
        raise TypeError(
            f"the target must be a script path, '-m module' or a module-level function, got {function!r}"
        )
    where = f"{module_name}.{name}"
    if "<lambda>" in name or "<locals>" in name:
        kind = "a lambda" if "<lambda>" in name.rsplit(".", 1)[-1] else "a function defined inside another"
        raise TypeError(
            f"{where} is {kind}: a check runs the function in fresh processes, which import it by its "
            "module and name, and it has none; define it at module level"
        )
    if module_name == "__main__":
        raise TypeError(
            f"{name} is defined in __main__ (the script being run): the fresh processes cannot import it "
            "without running that script again; move it into a module and import it from there"
        )
    module = sys.modules.get(module_name)
    try:
        found = _resolve(module, name, methods=methods)
    except AttributeError:
        found = None
    if module is None or found is not _unwrapped(function):
        raise TypeError(
            f"{where} is not what importing {module_name} and looking up {name} gives (a decorator "
            "that replaced it?): a check's fresh processes could not find it; pass a module-level function"
        )
    file = getattr(module, "__file__", None)
    return FunctionCall(
        module=module_name,
        qualname=name,
        file=os.path.abspath(file) if file else None,
        root=_import_root(module_name, file),
        args=tuple(_encode(value, f"argument {i + 1}") for i, value in enumerate(args)),
        kwargs=tuple((key, _encode(value, f"argument {key!r}")) for key, value in (kwargs or {}).items()),
    )


def _unwrapped(function: Callable[..., Any]) -> Any:
    """A class's method looked up on the class is its function: compare like with like."""
    return function.__func__ if inspect.ismethod(function) else function


def _resolve(module: Any, qualname: str, *, methods: bool) -> Any:
    """What ``module.<qualname>`` is, as the runner finds it (a method's plain function)."""
    owner, obj = None, module
    for part in qualname.split("."):
        owner, obj = obj, getattr(obj, part)
    method = inspect.isclass(owner) and inspect.isfunction(inspect.getattr_static(owner, part))
    if method and not methods:
        raise TypeError(
            f"{module.__name__}.{qualname} is a method: a check cannot make its instance in the fresh "
            "processes; pass a module-level function"
        )
    return _unwrapped(obj)


def _import_root(module: str, file: str | None) -> str | None:
    """The directory ``module`` is imported from (``a/b/pkg/mod.py`` for ``pkg.mod``: ``a/b``)."""
    if not file:
        return None
    path = Path(os.path.abspath(file))
    parts = module.split(".")
    levels = len(parts) if path.stem == "__init__" else len(parts) - 1
    root = path.parent
    for part in reversed(parts[:levels]):
        if root.name != part:
            return None
        root = root.parent
    return os.fspath(root)


def _encode(value: Any, what: str) -> tuple[str, Any]:
    if isinstance(value, os.PathLike):
        return "path", os.fspath(value)
    try:
        same = json.loads(json.dumps(value, allow_nan=False)) == value
    except (TypeError, ValueError):
        same = False
    if not same:
        raise TypeError(
            f"{what} ({type(value).__name__}: {_short(value)}) cannot be passed to the fresh processes of a "
            "check unchanged: arguments travel as JSON (numbers, strings, booleans, None, lists, dicts with "
            "string keys; a path on its own); build anything else inside the function"
        )
    return "json", value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_RUNNER = """\
# Written by torchrepro.testing: calls {described} in a fresh process.
# Standalone: `python {name}` makes the same call without torchrepro (`{later}`: the variant).

import importlib
import importlib.util
import inspect
import json
import pathlib
import sys

CALL = json.loads({call!r})


def load(name, file):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if file is None or not (exc.name == name or name.startswith(f"{{exc.name}}.")):
            raise
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def value(kind, encoded):
    return pathlib.Path(encoded) if kind == "path" else encoded


if __name__ == "__main__":
    # the function's import root, then the calling process's sys.path in its order: the same imports
    front = ([CALL["root"]] if CALL["root"] is not None else []) + CALL["path"]
    sys.path[:] = list(dict.fromkeys(front + sys.path))
    owner, target = None, load(CALL["module"], CALL["file"])
    for part in CALL["qualname"].split("."):
        owner, target = target, getattr(target, part)
    if inspect.isclass(owner) and inspect.isfunction(inspect.getattr_static(owner, part)):
        target = getattr(owner(), part)  # a test method: pytest calls it on a new instance too
    args = [value(*a) for a in CALL["args"]]
    kwargs = {{k: value(*v) for k, v in CALL["kwargs"]}}
    if sys.argv[1:] == [{later!r}]:  # the variant a check compares against the call above
        kwargs.update((k, value(*v)) for k, v in CALL["later_kwargs"])
    target(*args, **kwargs)
"""


def write_runner(directory: str | os.PathLike[str], call: FunctionCall, *, name: str = RUNNER_NAME) -> Path:
    """Write the runner script of ``call`` into ``directory`` as ``name``; return its path."""
    path = Path(directory) / name
    search = [os.path.abspath(p or os.curdir) for p in sys.path]
    encoded = {
        "module": call.module,
        "qualname": call.qualname,
        "file": call.file,
        "root": call.root,
        "path": list(dict.fromkeys(p for p in search if os.path.exists(p))),
        "args": [list(a) for a in call.args],
        "kwargs": [[k, list(v)] for k, v in call.kwargs],
        "later_kwargs": [[k, list(v)] for k, v in call.later_kwargs],
    }
    text = _RUNNER.format(described=call.describe(), name=name, later=LATER, call=json.dumps(encoded))
    path.write_text(text, encoding="utf-8")
    return path
