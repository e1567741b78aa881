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

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import CodeType, FrameType, TracebackType
from typing import Any, Final, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from torchrepro._io import atomic_write_json
from torchrepro.errors import TraceError
from torchrepro.fingerprint import fingerprint, fingerprinting

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
_COMPILE_HOOKS_WARNING: Final = r"Using `torch.compile\(module\)` when there are global hooks"
# Ops that are bookkeeping, not computation (the profiler's record_function markers).
_IGNORED_NAMESPACES: Final = ("profiler.",)
_SHORT_SCALARS: Final = 96
_PLAIN_TENSOR_TYPES: Final = (torch.Tensor, torch.nn.Parameter)


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


# Caches shared by every recorder (code objects and op overloads are immortal in practice).
_CODE_KINDS: dict[CodeType, int] = {}
_OP_NAMES: dict[Any, str] = {}


class _Sites:
    """Where an op comes from: the module stack (global forward hooks) and the user's frame."""

    def __init__(self) -> None:
        self._stack: list[torch.nn.Module] = []
        self._names: dict[int, tuple[weakref.ref[torch.nn.Module], dict[int, str]]] = {}
        self._code_kind = _CODE_KINDS
        self._display: dict[str, str] = {}
        self._cwd = os.path.normcase(os.getcwd())
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
    """Hands every op to its owner.

    Not wrapped in ``torch._dynamo.disable`` up front, as torch does for dispatch modes: that
    wrapper imports dynamo on first use, which takes seconds and sets ``TORCHINDUCTOR_CACHE_DIR``
    in os.environ. Once dynamo is imported (the script uses ``torch.compile``), the handler is
    replaced by a dynamo-disabled one, so dynamo never compiles the recorder's own frames.
    """

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
        if "torch._dynamo" in sys.modules:
            _hide_from_dynamo()
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


_ObserverT = TypeVar("_ObserverT", bound="_Observer")


class _Observer:
    """Shared start/stop of the dispatch mode and the module hooks."""

    _what = "recorder"

    def __init__(self) -> None:
        self._sites = _Sites()
        self._mode: _Mode | None = None
        self._names = _OP_NAMES
        self._lock = threading.Lock()  # ops can arrive from other threads (collective callbacks)
        self._thread = threading.get_ident()
        self._pid = os.getpid()  # forked DataLoader workers inherit the mode: they pass ops through
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
        self._sites = _Sites()
        self._sites.install()
        self._thread = threading.get_ident()
        self._pid = os.getpid()
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

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = self._op_name(func)
        if name.startswith(_IGNORED_NAMESPACES) or fingerprinting() or os.getpid() != self._pid:
            return func(*args, **kwargs)
        sites = self._sites
        with self._lock:
            module, location, backward = sites.attribute(sys._getframe(1))
        out = func(*args, **kwargs)
        key = (name, module, location, backward)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            if not backward or torch.is_grad_enabled():
                sites.remember(out, (module, location))
        return out


# --------------------------------------------------------------------------------------------
# Tracer: digests of every op's inputs and outputs (for locating a divergence)
# --------------------------------------------------------------------------------------------

_COLLECTIVE_NAMESPACES: Final = ("c10d.", "_c10d_functional.", "c10d_functional.")
_RANDOM_OPS: Final = (
    "bernoulli",
    "dropout",
    "normal",
    "uniform",
    "rand",
    "multinomial",
    "exponential",
    "geometric",
    "log_normal",
    "cauchy",
    "random_",
)


@dataclasses.dataclass(frozen=True)
class _OpInfo:
    """What an op's schema says about its arguments (positional index or keyword name)."""

    uninit: bool  # its result is uninitialised memory
    written: frozenset[int | str]  # arguments it writes (schema ``(a!)``, plus hidden writes)
    overwritten: frozenset[int | str]  # arguments it writes entirely without reading them
    view: bool  # its outputs are views of its inputs: their values follow from the inputs' values


_OP_INFOS: dict[Any, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    schema = func._schema
    name = schema.name
    written: set[int | str] = set()
    overwritten: set[int | str] = set()
    for i, arg in enumerate(schema.arguments):
        key: int | str = arg.name if arg.kwarg_only else i
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.add(key)
            if arg.is_out:
                overwritten.add(key)
    written.update(_HIDDEN_WRITES.get(name, ()))
    if name.startswith("c10d::") and name.endswith("_"):  # in-place collectives carry no (a!) marks
        written.update(i for i, arg in enumerate(schema.arguments) if "Tensor" in str(arg.type))
    if name in _FULL_WRITE_OPS:
        overwritten.add(0)
    view = bool(getattr(func, "is_view", False)) and not written
    return _OpInfo(name in _UNINIT_OPS, frozenset(written), frozenset(overwritten), view)


def _scalar_text(value: Any) -> str:
    if isinstance(value, _PLAIN_SCALARS):
        return repr(value)
    if isinstance(value, torch.memory_format):
        return str(value)
    if isinstance(value, torch.Generator):
        return "<generator>"  # its state is hidden state, like the global RNG's
    return f"<{type(value).__name__}>"  # opaque objects (process groups, ...): repr has addresses


def _short_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _scalar_token(parts: list[str]) -> str:
    text = "|".join(parts)
    if len(text) <= _SHORT_SCALARS:
        return "s:" + text
    return "s#" + _short_hash(text)


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse, nested, wrapper subclasses
        return 0


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors keep no version counter: never reuse their digest
        return -1


_PARALLEL_DIGEST_BYTES: Final = 4 << 20
_DIGEST_CHUNK_BYTES: Final = 1 << 20
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def _hash_pool() -> ThreadPoolExecutor:
    """Threads hashing the chunks of large tensors (hashlib releases the GIL); one per process."""
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="torchrepro-digest"
        )
        _pool_pid = os.getpid()
    return _pool


def _chunks(data: memoryview) -> Iterator[memoryview]:
    # A fixed chunk size: the digest depends on the bytes only, never on the number of threads.
    return (data[i : i + _DIGEST_CHUNK_BYTES] for i in range(0, len(data), _DIGEST_CHUNK_BYTES))


def _sha1_digest(chunk: memoryview) -> bytes:
    return hashlib.sha1(chunk, usedforsecurity=False).digest()


def _digest(t: torch.Tensor) -> str:
    """An exact digest of ``t``'s value (dtype, shape, every byte in row-major order).

    Dense CPU tensors are hashed in place with SHA-1 over their bytes (about twice the throughput
    of ``fingerprint``'s portable path, and no temporaries); every other kind goes to
    :func:`torchrepro.fingerprint`, which handles devices, layouts and odd dtypes.
    """
    if (
        t.is_cpu
        and t.layout == torch.strided
        and type(t) in _PLAIN_TENSOR_TYPES
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg() or t.is_quantized)
    ):
        n = t.numel() * t.element_size()
        h = hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode(), usedforsecurity=False)
        if n:
            data = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
            if n >= _PARALLEL_DIGEST_BYTES:
                h.update(b"chunked")
                h.update(b"".join(_hash_pool().map(_sha1_digest, _chunks(data))))
            else:
                h.update(data)
        return h.hexdigest()[:32]
    try:
        return fingerprint(t)
    except (TypeError, ValueError):  # meta/fake tensors and other kinds without readable values
        return f"opaque:{t.dtype}:{tuple(t.shape)}:{t.device.type}"


class Tracer(_Observer):
    """Record every aten op (forward and backward) with digests of its inputs and outputs.

    ``start()`` begins tracing on this thread; ``stop()`` ends it and writes the trace to ``path``
    (JSON, atomically) for :func:`compare_traces`. Also a context manager (see :func:`trace`).

    Digests are :func:`torchrepro.fingerprint` of every tensor (exact: every byte counts), computed
    once per tensor version and reused while the tensor is unchanged. In-place and ``out=`` writes
    are digested after the op as outputs; results of ``empty``-like ops, and values computed from
    them before they are overwritten, are recorded as ``uninit`` and never compared as data;
    non-tensor arguments (Python scalars, dtypes, shapes) form one more input.
    """

    _what = "Tracer"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self._reset()

    def _reset(self) -> None:
        self._value_index: dict[str, int] = {}
        self._op_index: dict[str, int] = {}
        self._site_index: dict[tuple[str | None, str | None], int] = {}
        self._records: list[list[Any]] = []
        self._cache: dict[int, tuple[weakref.ref[torch.Tensor], int, int, int, str]] = {}
        self._epochs: dict[int, int] = {}
        self._tainted: dict[int, weakref.ref[torch.Tensor]] = {}
        self._prune_at = 4096
        self._infos = _OP_INFOS

    def start(self) -> None:
        """Start tracing (raises ``TraceError`` if already started)."""
        if self._mode is None:
            self._reset()
        self._start()

    def stop(self) -> Path:
        """Stop tracing, write the trace file and return its path."""
        self._stop()
        try:
            self._write()
        finally:
            self._cache.clear()
            self._tainted.clear()
        return self.path

    def __len__(self) -> int:
        """The number of ops traced so far."""
        return len(self._records)

    # -- file -----------------------------------------------------------------------------------
    def _write(self) -> None:
        rank = None
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():  # type: ignore[no-untyped-call]
            rank = int(dist.get_rank())
        doc = {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "torch": torch.__version__,
            "rank": rank,
            "ops": list(self._op_index),
            "sites": [list(site) for site in self._site_index],
            "values": list(self._value_index),
            "records": self._records,
        }
        try:
            atomic_write_json(self.path, doc, indent=None)
        except OSError as exc:
            raise TraceError(f"Cannot write the op trace to {self.path}: {exc}.") from None

    # -- digests --------------------------------------------------------------------------------
    def _intern(self, table: dict[Any, int], key: Any) -> int:
        index = table.get(key)
        if index is None:
            index = table[key] = len(table)
        return index

    def _token(self, t: torch.Tensor) -> str:
        key = id(t)
        ref = self._tainted.get(key)
        if ref is not None and ref() is t:
            return _UNINIT
        version = _version(t)
        ptr = _storage_ptr(t)
        epoch = self._epochs.get(ptr, 0)
        entry = self._cache.get(key)
        if (
            entry is not None
            and entry[1] == version
            and entry[2] == ptr
            and entry[3] == epoch
            and version >= 0
            and entry[0]() is t
        ):
            return entry[4]
        token = _digest(t)
        self._cache[key] = (weakref.ref(t), version, ptr, epoch, token)
        if len(self._cache) > self._prune_at:
            self._prune()
        return token

    def _set_token(self, t: torch.Tensor, token: str) -> str:
        ptr = _storage_ptr(t)
        self._cache[id(t)] = (weakref.ref(t), _version(t), ptr, self._epochs.get(ptr, 0), token)
        return token

    def _prune(self) -> None:
        self._cache = {k: e for k, e in self._cache.items() if e[0]() is not None}
        self._tainted = {k: r for k, r in self._tainted.items() if r() is not None}
        self._prune_at = max(4096, 2 * len(self._cache))

    def _taint(self, t: torch.Tensor, tainted: bool) -> None:
        if tainted:
            self._tainted[id(t)] = weakref.ref(t)
        elif id(t) in self._tainted:
            del self._tainted[id(t)]

    def _outputs(self, values: list[Any], uninit: bool, derived_from: str | None = None) -> list[str]:
        """Tokens of the op's outputs. ``derived_from`` (for view ops) names the outputs by the op and
        its input tokens instead of reading their bytes: a view's values are its input's values."""
        tokens: list[str] = []
        scalars: list[str] = []
        seen: set[int] = set()
        for v in _leaves(values):
            if isinstance(v, torch.Tensor):
                if id(v) not in seen:  # an in-place op returns the tensor it wrote
                    seen.add(id(v))
                    self._taint(v, uninit)
                    if uninit:
                        tokens.append(_UNINIT)
                    elif derived_from is not None:
                        text = f"{derived_from}|{len(tokens)}|{tuple(v.shape)}|{v.dtype}"
                        tokens.append(self._set_token(v, "v" + _short_hash(text)))
                    else:
                        tokens.append(self._token(v))
            else:
                scalars.append(_scalar_text(v))
        if scalars:
            tokens.append(_scalar_token(scalars))
        return tokens

    # -- the op ---------------------------------------------------------------------------------
    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = self._op_name(func)
        if (
            self._pause_depth
            or name.startswith(_IGNORED_NAMESPACES)
            or fingerprinting()
            or os.getpid() != self._pid
        ):
            return func(*args, **kwargs)
        with self._lock:
            info = self._infos.get(func)
            if info is None:
                info = self._infos[func] = _op_info(func)
            module, location, backward = self._sites.attribute(sys._getframe(1))
            inputs, reads_uninit = self._inputs(info, args, kwargs)
        out = func(*args, **kwargs)
        if name.startswith(_COLLECTIVE_NAMESPACES):
            _wait(out)  # an async collective's outputs hold their result only once it completes
        with self._lock:
            written = [_arg(args, kwargs, k) for k in info.written if _has(args, kwargs, k)]
            for t in _leaves(written):
                if isinstance(t, torch.Tensor):
                    ptr = _storage_ptr(t)
                    self._epochs[ptr] = self._epochs.get(ptr, 0) + 1
            derived = f"{name}|{'|'.join(inputs)}" if info.view else None
            outputs = self._outputs([out, *written], info.uninit or reads_uninit, derived)
            vi = self._value_index
            self._records.append(
                [
                    self._intern(self._op_index, name),
                    self._intern(self._site_index, (module, location)),
                    1 if backward else 0,
                    [self._intern(vi, tok) for tok in inputs],
                    [self._intern(vi, tok) for tok in outputs],
                    0 if threading.get_ident() == self._thread else 1,
                ]
            )
            if not backward or torch.is_grad_enabled():
                self._sites.remember(out, (module, location))
        return out

    def _inputs(self, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[str], bool]:
        """Tokens of the op's inputs (non-tensor arguments last, as one) and whether any is uninit."""
        inputs: list[str] = []
        scalars: list[str] = []
        reads_uninit = False
        items: list[tuple[int | str, Any]] = list(enumerate(args))
        if kwargs:
            items.extend(kwargs.items())
        for key, value in items:
            if isinstance(value, torch.Tensor):
                if key in info.overwritten:
                    inputs.append(_OVERWRITTEN)
                    continue
                token = self._token(value)
                reads_uninit = reads_uninit or token == _UNINIT
                inputs.append(token)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    if isinstance(v, torch.Tensor):
                        token = _OVERWRITTEN if key in info.overwritten else self._token(v)
                        reads_uninit = reads_uninit or token == _UNINIT
                        inputs.append(token)
                    else:
                        scalars.append(_scalar_text(v))
            else:
                scalars.append(_scalar_text(value))
        if scalars:
            inputs.append(_scalar_token(scalars))
        return inputs, reads_uninit


def _has(args: tuple[Any, ...], kwargs: dict[str, Any], key: int | str) -> bool:
    return key < len(args) if isinstance(key, int) else key in kwargs


def _wait(out: Any) -> None:
    """Wait for the ``Work`` handles a c10d op returned (waiting twice is harmless)."""
    for v in _leaves(out):
        if isinstance(v, torch.ScriptObject) and hasattr(v, "wait"):
            v.wait()


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], key: int | str) -> Any:
    return args[key] if isinstance(key, int) else kwargs[key]


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif value is not None:
        yield value


def trace(path: str | os.PathLike[str]) -> Tracer:
    """Trace every aten op run inside ``with trace(path):`` and write the trace to ``path``.

    Two traces of the same code (two processes, two seeds, two machines) are compared with
    :func:`compare_traces`, which names the first op whose output differs.

    >>> import os, tempfile, torch
    >>> import torchrepro
    >>> d = tempfile.mkdtemp()
    >>> def step(factor):
    ...     x = torch.arange(4.0)
    ...     return (x * 2).sum() * factor
    >>> with torchrepro.trace(os.path.join(d, "a.json")):
    ...     _ = step(1.0)
    >>> with torchrepro.trace(os.path.join(d, "b.json")):
    ...     _ = step(1.5)
    >>> d = torchrepro.compare_traces(os.path.join(d, "a.json"), os.path.join(d, "b.json"))
    >>> d.op, d.inputs_equal
    ('aten.mul.Tensor', False)
    """
    return Tracer(path)


# --------------------------------------------------------------------------------------------
# Comparing traces
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Record:
    op: str
    module: str | None
    location: str | None
    backward: bool
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    index: int  # position in its trace
    lane: int  # 0: the thread that started the tracer; 1: any other thread


@dataclasses.dataclass(frozen=True)
class _Trace:
    path: str
    rank: int | None
    records: tuple[_Record, ...]


def _load_trace(path: str | os.PathLike[str]) -> _Trace:
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise TraceError(
            f"Op trace {where} does not exist; write one with torchrepro.trace({where!r})."
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"Op trace {where} is unreadable: {exc}.") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise TraceError(f"{where} is not a torchrepro op trace (expected format {_FORMAT!r}).")
    if doc.get("version") != _FORMAT_VERSION:
        raise TraceError(
            f"Op trace {where} has format version {doc.get('version')!r}; this torchrepro reads version "
            f"{_FORMAT_VERSION}. Record both traces with the same torchrepro version."
        )
    try:
        ops, sites, values = doc["ops"], doc["sites"], doc["values"]
        records = tuple(
            _Record(
                op=ops[op],
                module=sites[site][0],
                location=sites[site][1],
                backward=bool(backward),
                inputs=tuple(values[i] for i in ins),
                outputs=tuple(values[i] for i in outs),
                index=index,
                lane=int(rest[0]) if rest else 0,
            )
            for index, (op, site, backward, ins, outs, *rest) in enumerate(doc["records"])
        )
        rank = doc.get("rank")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise TraceError(f"Op trace {where} is malformed ({type(exc).__name__}: {exc}).") from None
    return _Trace(where, rank if isinstance(rank, int) else None, records)


def _describe_input(index: int, a: str, b: str) -> str:
    if a.startswith("s:") and b.startswith("s:"):
        return f"its non-tensor arguments differ ({a[2:]} vs {b[2:]})"
    if a.startswith("s") and b.startswith("s"):
        return "its non-tensor arguments differ"
    return f"tensor input {index} differs"


def compare_traces(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> OpDivergence | None:
    """The first op at which traces ``a`` and ``b`` part, or ``None`` when every op matches.

    Ops are aligned by their order. The first op whose outputs differ is where the difference
    enters: every earlier op produced bitwise-equal outputs, so its inputs are equal too unless a
    value came from outside the traced ops (a Python scalar, a tensor made from Python data, a write
    the tracer did not see); ``inputs_equal`` and ``note`` say which. When the two runs issued
    different ops before any output differed, that op is reported with ``structural=True``.
    Ops that ran on other threads than the traced one (callbacks of collectives) are aligned among
    themselves, since their interleaving with the traced thread varies from run to run.
    Raises ``TraceError`` for a missing or malformed file.
    """
    ta, tb = _load_trace(a), _load_trace(b)
    found = []
    for lane in sorted({r.lane for r in ta.records} | {r.lane for r in tb.records}):
        d = _compare_lane(ta, tb, lane)
        if d is not None:
            found.append(d)
    return min(found, key=lambda d: d.index) if found else None


def _compare_lane(ta: _Trace, tb: _Trace, lane: int) -> OpDivergence | None:
    la = [r for r in ta.records if r.lane == lane]
    lb = [r for r in tb.records if r.lane == lane]
    for ra, rb in zip(la, lb, strict=False):
        if ra.op != rb.op or len(ra.inputs) != len(rb.inputs) or len(ra.outputs) != len(rb.outputs):
            where_b = f"{rb.op} ({rb.module or 'no module'}, {rb.location or 'unknown line'})"
            return OpDivergence(
                op=ra.op,
                module=ra.module,
                location=ra.location,
                backward=ra.backward,
                index=ra.index,
                inputs_equal=ra.inputs == rb.inputs,
                structural=True,
                other_op=rb.op,
                rank=ta.rank,
                note=(
                    f"the runs issued different ops at op {ra.index} before any output differed: {ra.op} "
                    f"here, {where_b} in the other run. Control flow parted in Python (a branch on the "
                    "time, a process id, set or dict order, the environment)."
                ),
            )
        if ra.outputs != rb.outputs:
            return _divergence(ra, rb, ta.rank)
    if len(la) == len(lb):
        return None
    n = min(len(la), len(lb))
    longer, shorter, extra = (ta, tb, la[n]) if len(la) > len(lb) else (tb, ta, lb[n])
    return OpDivergence(
        op=extra.op,
        module=extra.module,
        location=extra.location,
        backward=extra.backward,
        index=la[n].index if len(la) > n else len(ta.records),
        inputs_equal=False,
        structural=True,
        other_op=None,
        rank=ta.rank,
        note=(
            f"{shorter.path} ends after {n} equal ops; {longer.path} goes on with {extra.op}. "
            "Control flow parted in Python, or one trace was stopped early."
        ),
    )


def _divergence(ra: _Record, rb: _Record, rank: int | None) -> OpDivergence:
    differing = [j for j, (x, y) in enumerate(zip(ra.inputs, rb.inputs, strict=True)) if x != y]
    outs = [j for j, (x, y) in enumerate(zip(ra.outputs, rb.outputs, strict=True)) if x != y]
    what = f"output {outs[0]}" if len(ra.outputs) > 1 else "its output"
    if not differing:
        cause = (
            "it draws from a random number generator whose state differs between the runs"
            if any(r in ra.op for r in _RANDOM_OPS)
            else "the op is nondeterministic here, or reads state the tracer cannot see"
        )
        note = f"every input is bitwise equal but {what} differs: {cause}."
    else:
        reasons = "; ".join(_describe_input(j, ra.inputs[j], rb.inputs[j]) for j in differing[:3])
        note = (
            f"{what} differs and {reasons}, although every earlier op matched: the value comes from "
            "outside the traced ops (Python data such as a process id or the time, a tensor built from "
            "it, or a write the tracer did not see)."
        )
    if ra.op.startswith(_COLLECTIVE_NAMESPACES):
        note += (
            " This is a collective: its result also depends on the other ranks, so the source is "
            "likely on another rank; compare their traces."
        )
    return OpDivergence(
        op=ra.op,
        module=ra.module,
        location=ra.location,
        backward=ra.backward,
        index=ra.index,
        inputs_equal=not differing,
        rank=rank,
        note=note,
    )
