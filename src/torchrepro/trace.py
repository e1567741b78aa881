"""Op-level tracing: which aten op, module and source line made two runs part.

Invariants:
- This is the only module that touches torch's dispatch internals (``TorchDispatchMode``, the
  autograd node being executed, node metadata). Nothing else in torchrepro imports them.
- Every aten op of forward and backward is attributed to a module path (dotted, without the root's
  name: ``layer2.drop``; an op in the root's own ``forward`` gets the root's class name) and to a
  ``file:line`` of user code: the first frame outside torch, torchrepro and the standard library,
  relative to the current directory when below it. A backward op of a built-in function gets the
  module and line of the forward op that created its autograd node; a backward op issued by user
  code that runs inside backward (a custom ``autograd.Function.backward``, a hook, a checkpoint
  recomputation) gets that user line.
- A trace digests the inputs and outputs of every op exactly (every byte); contents of
  uninitialised memory (``empty``, ``empty_like``, ... and whatever is computed from it before it
  is overwritten) are never digested as data. In-place and ``out=`` writes, and the hidden running
  statistics update of batch norm, are digested after the op as outputs.
- Trace files are JSON, written atomically; recording changes no numerics and no RNG state.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import CodeType, FrameType, TracebackType
from typing import Any, Final

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from torchrepro.errors import TraceError

__all__ = ["OpDivergence", "OpEvent", "OpRecorder", "Tracer", "compare_traces", "trace"]

_META_KEY: Final = "torchrepro.site"
"""Key under which an autograd node's ``metadata`` dict holds ``(module, location)`` of its forward op."""

_FORMAT: Final = "torchrepro.trace"
_FORMAT_VERSION: Final = 1

_current_autograd_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)

# Tokens that stand for values that are not data.
_UNINIT: Final = "uninit"
"""Contents of uninitialised memory, or computed from it: not compared."""
_OVERWRITTEN: Final = "overwritten"
"""An argument the op overwrites entirely without reading it (``out=``, ``self`` of ``fill_``...)."""

# Ops whose result is uninitialised memory.
_UNINIT_OPS: Final = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::empty_permuted",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::_empty_affine_quantized",
        "aten::_empty_per_channel_affine_quantized",
    }
)
# In-place ops that overwrite all of ``self`` without reading its contents.
_FULL_WRITE_OPS: Final = frozenset(
    {
        "aten::fill_",
        "aten::zero_",
        "aten::copy_",
        "aten::normal_",
        "aten::uniform_",
        "aten::bernoulli_",
        "aten::random_",
        "aten::exponential_",
        "aten::geometric_",
        "aten::log_normal_",
        "aten::cauchy_",
    }
)
# Ops that write arguments their schema does not mark as written (positional indices).
_HIDDEN_WRITES: Final[Mapping[str, tuple[int, ...]]] = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}
# Scalars whose repr is stable across processes.
_PLAIN_SCALARS: Final = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout)
_MAX_PENDING_ATTEMPTS: Final = 8
# Ops that are bookkeeping, not computation (the profiler's record_function markers).
_IGNORED_NAMESPACES: Final = ("profiler.",)
_SHORT_SCALARS: Final = 96


# --------------------------------------------------------------------------------------------
# Public data
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One kind of aten op seen by an :class:`OpRecorder`, with where it was issued.

    ``op`` is the aten overload name (``aten.convolution_backward.default``); ``module`` the dotted
    path of the module that ran it (``None`` outside any module); ``location`` the ``file:line`` of
    user code that issued it (for a backward op of a built-in function: the forward line that
    created it); ``backward`` whether it ran inside autograd's backward; ``count`` how many times
    this (op, module, location, backward) combination ran.
    """

    op: str
    module: str | None
    location: str | None
    backward: bool
    count: int = 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``OpEvent.from_dict`` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OpEvent:
        """Read an event written by :meth:`to_dict`; raises ``TraceError`` naming a bad field."""
        try:
            op, module, location = d["op"], d.get("module"), d.get("location")
            backward, count = d.get("backward", False), d.get("count", 1)
        except (KeyError, TypeError, AttributeError):
            raise TraceError(f"An op event needs at least the field 'op'; got {d!r}.") from None
        if not isinstance(op, str) or not isinstance(backward, bool):
            raise TraceError(f"An op event needs 'op' as a string and 'backward' as a bool; got {d!r}.")
        if not all(v is None or isinstance(v, str) for v in (module, location)):
            raise TraceError(f"An op event needs 'module' and 'location' as strings or null; got {d!r}.")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise TraceError(f"An op event needs 'count' as a positive integer; got {d!r}.")
        return cls(op=op, module=module, location=location, backward=backward, count=count)


@dataclasses.dataclass(frozen=True)
class OpDivergence:
    """The first op at which two traces part: where the difference enters, not a victim downstream.

    ``op``, ``module``, ``location`` and ``backward`` are as in :class:`OpEvent` (taken from the
    first trace); ``index`` is the op's position in the trace; ``rank`` the distributed rank the
    first trace was recorded on (``None`` when not distributed). ``inputs_equal`` is true when every
    input of the op was bitwise equal in both runs and only its output differs (the op itself is
    nondeterministic, or reads hidden state such as an RNG); when false, ``note`` says which input
    differed although no earlier traced op produced a difference (a Python scalar, a tensor built
    from Python data, or a value written outside the traced ops). ``structural`` is true when the
    two runs issued different ops at ``index`` (control flow parted); ``other_op`` is then the op
    of the second trace (``None`` when it ended).
    """

    op: str
    module: str | None
    location: str | None
    backward: bool
    index: int
    inputs_equal: bool
    structural: bool = False
    other_op: str | None = None
    rank: int | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Attribution: module stack, source lines, autograd node -> forward site
# --------------------------------------------------------------------------------------------

_USER, _LIBRARY, _ENGINE = 0, 1, 2
_LIBRARY_DIRS: tuple[str, ...] = tuple(
    os.path.normcase(os.path.dirname(os.path.abspath(f))) + os.sep
    for f in (torch.__file__, __file__, os.__file__)
)
_ENGINE_CODES: frozenset[CodeType] = frozenset(
    fn.__code__
    for fn in (getattr(torch.autograd.graph, "_engine_run_backward", None),)
    if fn is not None and hasattr(fn, "__code__")
)
_WRAPPER_PREFIXES: Final[Mapping[str, str]] = {
    "DistributedDataParallel": "module.",
    "DataParallel": "module.",
    "OptimizedModule": "_orig_mod.",
}


class _Sites:
    """Where an op comes from: the module stack (global forward hooks) and the user's frame."""

    def __init__(self) -> None:
        self._stack: list[torch.nn.Module] = []
        self._names: dict[int, tuple[weakref.ref[torch.nn.Module], dict[int, str]]] = {}
        self._code_kind: dict[CodeType, int] = {}
        self._display: dict[str, str] = {}
        self._cwd = os.path.normcase(os.getcwd())
        self._handles: list[Any] = []
        self._pending: list[list[Any]] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def install(self) -> None:
        from torch.nn.modules import module as nn_module

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
        if not stack:
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
    def _kind(self, code: CodeType) -> int:
        kind = self._code_kind.get(code)
        if kind is None:
            if code in _ENGINE_CODES:
                kind = _ENGINE
            else:
                filename = code.co_filename
                if filename.startswith("<frozen") or filename.startswith("<built-in"):
                    kind = _LIBRARY
                else:
                    path = os.path.normcase(os.path.abspath(filename))
                    kind = _LIBRARY if path.startswith(_LIBRARY_DIRS) else _USER
            self._code_kind[code] = kind
        return kind

    def _show(self, filename: str) -> str:
        shown = self._display.get(filename)
        if shown is None:
            path = os.path.abspath(filename)
            norm = os.path.normcase(path)
            shown = os.path.relpath(path, self._cwd) if norm.startswith(self._cwd + os.sep) else path
            self._display[filename] = shown
        return shown

    def user_location(self, frame: FrameType | None) -> tuple[str | None, bool]:
        """``(file:line, False)`` of the innermost user frame, or ``(None, True)`` when the walk
        reaches autograd's engine entry first (the op runs inside backward on behalf of torch)."""
        while frame is not None:
            code = frame.f_code
            kind = self._kind(code)
            if kind == _USER:
                return f"{self._show(code.co_filename)}:{frame.f_lineno}", False
            if kind == _ENGINE:
                return None, True
            frame = frame.f_back
        return None, False

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

    def attribute(self, frame: FrameType | None) -> tuple[str | None, str | None, bool]:
        """``(module, location, backward)`` of the op being dispatched now."""
        self.resolve()
        node = _current_autograd_node()
        if node is None:
            return self.module_path(), self.user_location(frame)[0], False
        site = node.metadata.get(_META_KEY)
        location, in_engine = self.user_location(frame)
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


# --------------------------------------------------------------------------------------------
# The dispatch mode both recorders share
# --------------------------------------------------------------------------------------------


class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Hands every op to its owner. Not wrapped in ``torch._dynamo.disable``: that wrapper imports
    dynamo on first use, which takes seconds and sets ``TORCHINDUCTOR_CACHE_DIR`` in os.environ."""

    def __init__(self, owner: _Observer) -> None:
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
        return self._owner._dispatch(func, tuple(args), dict(kwargs) if kwargs else {})


class _DynamoSafeMode(_Mode):  # type: ignore[no-untyped-call]
    """The same, kept out of dynamo's tracing: used when dynamo is already imported."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    __torch_dispatch__ = _Mode.__torch_dispatch__


class _Observer:
    """Shared start/stop of the dispatch mode and the module hooks."""

    _what = "recorder"

    def __init__(self) -> None:
        self._sites = _Sites()
        self._mode: _Mode | None = None
        self._names: dict[Any, str] = {}

    @property
    def active(self) -> bool:
        """Whether the recorder is between ``start()`` and ``stop()``."""
        return self._mode is not None

    def _start(self) -> None:
        if self._mode is not None:
            raise TraceError(f"This {self._what} is already started; call stop() before starting it again.")
        self._sites = _Sites()
        self._sites.install()
        mode = (_DynamoSafeMode if "torch._dynamo" in sys.modules else _Mode)(self)
        try:
            mode.__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            self._sites.remove()
            raise
        self._mode = mode

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
        try:
            mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        finally:
            self._sites.remove()

    def _op_name(self, func: Any) -> str:
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = str(func)
        return name

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError  # pragma: no cover


# --------------------------------------------------------------------------------------------
# OpRecorder: which ops ran, where (for audit)
# --------------------------------------------------------------------------------------------


class OpRecorder(_Observer):
    """Record every aten op of forward and backward with its module, source line and direction.

    ``start()`` begins recording on this thread; ``stop()`` ends it and returns one
    :class:`OpEvent` per distinct (op, module, location, backward), in first-seen order, with a
    count. Also a context manager (``with OpRecorder() as rec: ...; rec.events``).

    >>> import torch
    >>> from torchrepro.trace import OpRecorder
    >>> lin = torch.nn.Linear(2, 1)
    >>> with OpRecorder() as rec:
    ...     lin(torch.ones(1, 2)).sum().backward()
    >>> sorted({e.op for e in rec.events if e.module == "Linear" and not e.backward})
    ['aten.addmm.default', 'aten.t.default']
    """

    _what = "OpRecorder"

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[tuple[str, str | None, str | None, bool], int] = {}
        self._events: list[OpEvent] = []

    def start(self) -> None:
        """Start recording (raises ``TraceError`` if already started)."""
        self._counts = {}
        self._start()

    def stop(self) -> list[OpEvent]:
        """Stop recording and return the events (also kept as :attr:`events`)."""
        self._stop()
        self._events = [OpEvent(op, m, loc, bw, n) for (op, m, loc, bw), n in self._counts.items()]
        return list(self._events)

    @property
    def events(self) -> list[OpEvent]:
        """The events returned by the last ``stop()``."""
        return list(self._events)

    def __enter__(self) -> OpRecorder:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = self._op_name(func)
        if name.startswith(_IGNORED_NAMESPACES):
            return func(*args, **kwargs)
        sites = self._sites
        module, location, backward = sites.attribute(sys._getframe(1))
        out = func(*args, **kwargs)
        key = (name, module, location, backward)
        self._counts[key] = self._counts.get(key, 0) + 1
        if not backward or torch.is_grad_enabled():
            sites.remember(out, (module, location))
        return out


# --------------------------------------------------------------------------------------------
# Tracer (under construction)
# --------------------------------------------------------------------------------------------


class Tracer(_Observer):
    """Placeholder: op-level digests (under construction)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)


def trace(path: str | os.PathLike[str]) -> Tracer:
    """Placeholder: ``with torchrepro.trace(path):`` (under construction)."""
    raise NotImplementedError("under construction")


def compare_traces(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> OpDivergence | None:
    """Placeholder: the first op at which two traces part (under construction)."""
    raise NotImplementedError("under construction")
