"""The dispatch mode both recorders share, and the start/stop of an observer around it.

Invariants:
- torch's dispatch internals (``TorchDispatchMode``, the current dispatch mode) are imported here
  only; nothing outside ``torchrepro.tracing`` imports them, and ``ops`` and ``compare`` do not
  import this module.
- The mode hands every op to its observer's ``_dispatch``; it changes no numerics and no RNG state.
- Observers stop in the reverse order of starting; ``start`` and ``stop`` install and remove the
  module hooks and the warnings filter together, also when entering the mode fails.
- Dynamo is never imported by the mode; once the script imports it, the handler is dynamo-disabled.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from torchrepro.errors import TraceError
from torchrepro.tracing.sites import Sites

_COMPILE_HOOKS_WARNING: Final = r"Using `torch.compile\(module\)` when there are global hooks"
# Ops that are bookkeeping, not computation (the profiler's record_function markers).
IGNORED_NAMESPACES: Final = ("profiler.",)

# Cache shared by every recorder (op overloads are immortal in practice).
_OP_NAMES: dict[Any, str] = {}


# --------------------------------------------------------------------------------------------
# The dispatch mode both recorders share
# --------------------------------------------------------------------------------------------


class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Hands every op to its owner.

    Not wrapped in ``torch._dynamo.disable`` up front, as torch does for dispatch modes: that
    wrapper imports dynamo on first use, which takes seconds and sets ``TORCHINDUCTOR_CACHE_DIR``
    in os.environ. Once dynamo is imported (the script uses ``torch.compile``), the handler is
    replaced by a dynamo-disabled one, so dynamo never compiles the recorder's own frames.
    """

    def __init__(self, owner: Observer) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._owner = owner

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None and hasattr(dynamo, "disable"):  # imported, not half-way (torch 2.6
            _hide_from_dynamo()  # runs tensor ops while importing dynamo, under this mode)
        return _handle(self, func, types, args, kwargs)


def _handle(
    mode: _Mode,
    func: Any,
    types: Sequence[type],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> Any:
    return mode._owner._dispatch(func, tuple(args), dict(kwargs) if kwargs else {})


_hidden_from_dynamo = False


def _hide_from_dynamo() -> None:
    """Route ops through a dynamo-disabled handler from now on (dynamo is already imported)."""
    global _hidden_from_dynamo
    if _hidden_from_dynamo:
        return
    import torch._dynamo

    handler = torch._dynamo.disable(_handle, recursive=True)  # type: ignore[no-untyped-call]
    _Mode.__torch_dispatch__ = handler  # type: ignore[method-assign]
    _hidden_from_dynamo = True


_ObserverT = TypeVar("_ObserverT", bound="Observer")

# Started observers; a forked child (a DataLoader worker inherits the mode) marks them, so that
# they pass its ops through without asking the kernel for the process id on every op.
_STARTED: weakref.WeakSet[Observer] = weakref.WeakSet()


def _mark_forked() -> None:
    for observer in list(_STARTED):
        observer._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)


class Observer:
    """Shared start/stop of the dispatch mode and the module hooks."""

    _what = "recorder"

    def __init__(self) -> None:
        self._sites = Sites()
        self._mode: _Mode | None = None
        self._names = _OP_NAMES
        self._lock = threading.Lock()  # ops can arrive from other threads (collective callbacks)
        self._thread = threading.get_ident()
        self._forked = False  # set in forked children (DataLoader workers): they pass ops through
        self._filter: Any = None
        self._pause_depth = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A block whose ops pass through unrecorded (the bootstrap wraps DataLoader fetches in it)."""
        self._pause_depth += 1
        try:
            yield
        finally:
            self._pause_depth -= 1

    @property
    def active(self) -> bool:
        """Whether the recorder is between ``start()`` and ``stop()``."""
        return self._mode is not None

    def _start(self) -> None:
        if self._mode is not None:
            raise TraceError(f"This {self._what} is already started; call stop() before starting it again.")
        self._sites = Sites()
        self._sites.install()
        self._thread = threading.get_ident()
        self._forked = False
        # torch warns that compiled modules see global module hooks twice; ours expect that.
        warnings.filterwarnings("ignore", message=_COMPILE_HOOKS_WARNING, category=UserWarning)
        self._filter = warnings.filters[0]
        if "torch._dynamo" in sys.modules:
            _hide_from_dynamo()
        mode = _Mode(self)
        try:
            mode.__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            self._sites.remove()
            self._remove_filter()
            raise
        self._mode = mode
        _STARTED.add(self)

    def _remove_filter(self) -> None:
        with contextlib.suppress(ValueError):
            warnings.filters.remove(self._filter)  # type: ignore[attr-defined]

    def _stop(self) -> None:
        mode = self._mode
        if mode is None:
            raise TraceError(f"This {self._what} is not started; call start() first.")
        if _get_current_dispatch_mode() is not mode:
            raise TraceError(
                f"Cannot stop this {self._what}: another dispatch mode entered after start() is still "
                "active on this thread; stop recorders in the reverse order of starting them."
            )
        self._mode = None
        _STARTED.discard(self)
        try:
            mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        finally:
            self._sites.remove()
            self._remove_filter()

    def start(self) -> None:
        raise NotImplementedError  # pragma: no cover

    def stop(self) -> Any:
        raise NotImplementedError  # pragma: no cover

    def __enter__(self: _ObserverT) -> _ObserverT:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _op_name(self, func: Any) -> str:
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = str(func)
        return name

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError  # pragma: no cover
