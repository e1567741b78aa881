"""Attribution of every aten op to a module path and a ``file:line`` of user code.

Invariants:
- A module path is dotted, without the root's name (``layer2.drop``); an op in the root's own
  ``forward`` gets the root's class name; DDP, DataParallel and ``torch.compile`` wrappers are
  seen through.
- A location is the user's line as ``torchrepro._frames`` finds it (the walker the audit uses too):
  the first frame outside torch, torchrepro, the standard library, generated code and the
  frameworks (Lightning, transformers, accelerate: an op Lightning issues gets the user's line that
  made Lightning act), relative to the directory the recorder started in when below it.
- An op issued by torch's data loading code (``torch/utils/data/``: iterators, collation, the
  pin-memory thread; ``torch/multiprocessing/``: tensors rebuilt from another process) before any
  user frame is reached belongs to data loading, on any thread: ``attribute(..., skip_loading=True)``
  says so (None) instead of naming a site, so a tracer can leave it out of the op stream it aligns.
- A backward op of a built-in function gets the module and line of the forward op that created its
  autograd node (kept in the node's ``metadata``); a backward op issued by user code that runs
  inside backward gets that user line.
- The global module hooks live only between ``install()`` and ``remove()``; the module stack is the
  installing thread's.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Mapping
from types import CodeType, FrameType
from typing import Any, Final, Literal, overload

import torch

from torchrepro._frames import Walker

_META_KEY: Final = "torchrepro.site"
"""Key under which an autograd node's ``metadata`` dict holds ``(module, location)`` of its forward op."""

_current_autograd_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)
_MAX_PENDING_ATTEMPTS: Final = 8


# --------------------------------------------------------------------------------------------
# Attribution: module stack, source lines, autograd node -> forward site
# --------------------------------------------------------------------------------------------

_TORCH_DIR: Final = os.path.dirname(os.path.abspath(torch.__file__))
_LOADING_DIRS: Final = tuple(
    os.path.normcase(os.path.join(_TORCH_DIR, *parts)) + os.sep
    for parts in (
        ("utils", "data"),
        ("multiprocessing",),
    )  # DataLoader machinery; tensors from other processes
)
_ENGINE_CODES: frozenset[CodeType] = frozenset(
    fn.__code__
    for fn in (getattr(torch.autograd.graph, "_engine_run_backward", None),)
    if fn is not None and hasattr(fn, "__code__")
)
_WRAPPER_PREFIXES: Final[Mapping[str, str]] = {
    "DistributedDataParallel": "module.",
    "DataParallel": "module.",
    "InvariantDataParallel": "module.",
    "OptimizedModule": "_orig_mod.",
}


class Sites:
    """Where an op comes from: the module stack (global forward hooks) and the user's frame."""

    def __init__(self) -> None:
        self._stack: list[torch.nn.Module] = []
        self._names: dict[int, tuple[weakref.ref[torch.nn.Module], dict[int, str]]] = {}
        # the one walker (``_frames``): its kinds are shared by every recorder, its directory is now
        self._frames = Walker(stop=_ENGINE_CODES, mark=_LOADING_DIRS)
        self._handles: list[Any] = []
        self._pending: list[list[Any]] = []
        self._thread = threading.get_ident()

    # -- lifecycle ------------------------------------------------------------------------------
    def install(self) -> None:
        from torch.nn.modules import module as nn_module

        self._thread = threading.get_ident()
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._pre_hook),
            nn_module.register_module_forward_hook(self._post_hook, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()
        self._pending.clear()

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append(module)

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._stack
        if stack and stack[-1] is module:
            stack.pop()
            return
        for i in range(len(stack) - 1, -1, -1):  # unbalanced (started inside a forward): resync
            if stack[i] is module:
                del stack[i:]
                return

    # -- module path ----------------------------------------------------------------------------
    def _names_of(self, root: torch.nn.Module, *, refresh: bool = False) -> dict[int, str]:
        entry = self._names.get(id(root))
        if entry is not None and entry[0]() is root and not refresh:
            return entry[1]
        prefix = _WRAPPER_PREFIXES.get(type(root).__name__)
        names: dict[int, str] = {}
        for name, sub in root.named_modules(remove_duplicate=True):
            if prefix is not None and name.startswith(prefix):
                name = name[len(prefix) :]
            elif prefix is not None and name == prefix[:-1]:
                name = ""
            names.setdefault(id(sub), name)
        self._names[id(root)] = (weakref.ref(root), names)
        return names

    def module_path(self) -> str | None:
        stack = self._stack
        if not stack or threading.get_ident() != self._thread:  # the stack is the tracing thread's
            return None
        module = stack[-1]
        names = self._names_of(stack[0])
        name = names.get(id(module))
        if name is None:
            names = self._names_of(stack[0], refresh=True)
            name = names.get(id(module))
        if name is None:  # not registered under the root (kept in a plain list, say)
            parent = next((names[id(m)] for m in reversed(stack[:-1]) if id(m) in names), "")
            return f"{parent}.{type(module).__name__}" if parent else type(module).__name__
        return name or type(module).__name__

    # -- source lines ---------------------------------------------------------------------------
    def user_location(self, frame: FrameType | None) -> tuple[str | None, bool]:
        """``(file:line, False)`` of the innermost user frame, or ``(None, True)`` when the walk
        reaches autograd's engine entry first (the op runs inside backward on behalf of torch)."""
        location, _, in_engine, _ = self._frames.walk(frame)
        return location, in_engine

    # -- autograd nodes -------------------------------------------------------------------------
    def remember(self, output: Any, site: tuple[str | None, str | None]) -> None:
        """Note the first floating tensor of a forward op's output; its autograd node, set once
        the op returns through autograd, learns ``site`` (see :meth:`resolve`)."""
        t = output
        if isinstance(output, (tuple, list)):
            t = next((x for x in output if isinstance(x, torch.Tensor)), None)
        if isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex):
            self._pending.append([weakref.ref(t), site, 0])

    def resolve(self) -> None:
        """Give the autograd nodes of recently created tensors the site of the op that made them."""
        if not self._pending:
            return
        keep = []
        for entry in self._pending:
            t = entry[0]()
            if t is None:
                continue
            fn = t.grad_fn
            if fn is not None:
                metadata = fn.metadata
                if _META_KEY not in metadata:
                    metadata[_META_KEY] = entry[1]
                continue
            entry[2] += 1
            if entry[2] < _MAX_PENDING_ATTEMPTS:
                keep.append(entry)
        self._pending = keep

    @overload
    def attribute(
        self, frame: FrameType | None, *, skip_loading: Literal[False] = False
    ) -> tuple[str | None, str | None, bool]: ...

    @overload
    def attribute(
        self, frame: FrameType | None, *, skip_loading: bool
    ) -> tuple[str | None, str | None, bool] | None: ...

    def attribute(
        self, frame: FrameType | None, *, skip_loading: bool = False
    ) -> tuple[str | None, str | None, bool] | None:
        """``(module, location, backward)`` of the op being dispatched now; with ``skip_loading``,
        None for an op that torch's data loading code issued (see the module's invariants)."""
        self.resolve()
        location, _, in_engine, loading = self._frames.walk(frame)  # loading: passed torch's data code
        if loading and skip_loading:
            return None
        node = _current_autograd_node()
        if node is None:
            return self.module_path(), location, False
        site = node.metadata.get(_META_KEY)
        module = self.module_path()  # non-empty only when a forward reruns inside backward
        if site is not None:
            if module is None:
                module = site[0]
            if location is None or in_engine:
                location = site[1]
        elif in_engine:  # no forward site known (AccumulateGrad, ...): the line that ran backward
            location = self.user_location(_engine_caller(frame))[0]
        return module, location, True


def _engine_caller(frame: FrameType | None) -> FrameType | None:
    while frame is not None and frame.f_code not in _ENGINE_CODES:
        frame = frame.f_back
    return frame.f_back if frame is not None else None
