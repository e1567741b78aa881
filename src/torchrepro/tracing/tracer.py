"""``Tracer``: exact digests of every aten op's inputs and outputs, written as a trace file.

Invariants:
- A trace digests the inputs and outputs of every op exactly (every byte), and a digest does not
  depend on the number of hashing threads. Contents of uninitialised memory (``empty``,
  ``empty_like``, ... and whatever is computed from it before it is overwritten) are never digested
  as data. In-place and ``out=`` writes, and the hidden running statistics update of batch norm, are
  digested after the op as outputs.
- Trace files are JSON (format and version from ``ops``, the digest algorithm from
  ``hashing.EXACT_DIGEST``), written atomically; tracing changes no numerics and no RNG state; ops
  inside ``paused()`` are not traced.
- Data loading is never part of the op stream two traces align: ops of DataLoader fetches (the
  bootstrap pauses ``__next__``) and every op torch's data loading code issues on any thread (tensors
  rebuilt from worker processes, collation, the pin-memory thread; ``sites``) run untraced, since
  how many run between two model ops depends on when worker batches arrive. Their writes still
  invalidate the digests of the storages they wrote.
- Per op, the Python work is one lookup of what the trace knows of the op, the attribution, and a
  digest lookup per tensor (a cache keyed by tensor, version, storage and write epoch); bytes are
  hashed once per tensor version.
- A collective's outputs are digested once its work handle completes; the tracer waits for it,
  except for point-to-point ops (``send``, ``recv``): gloo completes their work once per wait, so a
  second wait (the caller's) would block for ever. A received tensor is digested when the next op
  reads it (the caller has waited by then), or when the trace stops, into the ``recv`` op's record.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch

from torchrepro._io import atomic_write_json
from torchrepro._runtime import group_rank
from torchrepro.errors import TraceError
from torchrepro.hashing import EXACT_DIGEST, bytes_digest, fingerprinting
from torchrepro.hashing import exact_digest as _digest
from torchrepro.tracing.dispatch import IGNORED_NAMESPACES, Observer
from torchrepro.tracing.ops import COLLECTIVE_NAMESPACES, FORMAT, FORMAT_VERSION

if TYPE_CHECKING:
    from torchrepro.tracing.capture import CaptureRequest

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
        "c10d::recv_",  # the tensors received into
        "c10d::recv_any_source_",
        "c10d::alltoall_base_",  # collectives whose first argument is only written: their output
        "c10d::alltoall_",
        "c10d::_allgather_base_",
        "c10d::allgather_",
        "c10d::allgather_into_tensor_coalesced_",
        "c10d::_reduce_scatter_base_",
        "c10d::reduce_scatter_",
    }
)
# Point-to-point ops: their work handle must be waited on once, by the caller (see the invariants).
_POINT_TO_POINT: Final = frozenset({"c10d::send", "c10d::recv_", "c10d::recv_any_source_"})
# What a received tensor that no op read before the trace stopped, and that was freed, stands for.
_PENDING: Final = "pending"
# Ops that write arguments their schema does not mark as written (positional indices).
_HIDDEN_WRITES: Final[Mapping[str, tuple[int, ...]]] = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}
# Scalars whose repr is stable across processes.
_PLAIN_SCALARS: Final = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout)
_PLAIN_SCALAR_TYPES: Final = frozenset(_PLAIN_SCALARS)
_SHORT_SCALARS: Final = 96
_PLAIN_TENSOR_TYPES: Final = (torch.Tensor, torch.nn.Parameter)


# --------------------------------------------------------------------------------------------
# Tracer: digests of every op's inputs and outputs (for locating a divergence)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _OpInfo:
    """What an op's schema says about its arguments (positional index or keyword name)."""

    uninit: bool  # its result is uninitialised memory
    written: tuple[int | str, ...]  # arguments it writes, in schema order (``(a!)``, hidden writes)
    overwritten: frozenset[int | str]  # arguments it writes entirely without reading them
    view: bool  # its outputs are views of its inputs: their values follow from the inputs' values


_OP_INFOS: dict[Any, _OpInfo] = {}


@dataclasses.dataclass(frozen=True)
class _TracedOp:
    """An op as one trace sees it (made on its first call in the trace)."""

    name: str
    info: _OpInfo
    index: int  # in the trace's op table
    skip: bool  # bookkeeping, not computation: passed through untraced
    collective: bool  # its outputs are ready only once its work handle is waited on
    point_to_point: bool  # a collective whose work handle only the caller may wait on


def _op_info(func: Any) -> _OpInfo:
    schema = func._schema
    name = schema.name
    written: dict[int | str, None] = {}  # ordered: outputs are listed in the same order in every run
    overwritten: set[int | str] = set()
    for i, arg in enumerate(schema.arguments):
        key: int | str = arg.name if arg.kwarg_only else i
        if arg.alias_info is not None and arg.alias_info.is_write:
            written[key] = None
            if arg.is_out:
                overwritten.add(key)
    written.update(dict.fromkeys(_HIDDEN_WRITES.get(name, ())))
    if name.startswith("c10d::") and name.endswith("_"):  # in-place collectives carry no (a!) marks
        written.update((i, None) for i, arg in enumerate(schema.arguments) if "Tensor" in str(arg.type))
    if name in _FULL_WRITE_OPS:
        overwritten.add(0)
    view = bool(getattr(func, "is_view", False)) and not written
    return _OpInfo(name in _UNINIT_OPS, tuple(written), frozenset(overwritten), view)


def _scalar_text(value: Any) -> str:
    if type(value) in _PLAIN_SCALAR_TYPES or isinstance(value, _PLAIN_SCALARS):
        return repr(value)
    if isinstance(value, torch.memory_format):
        return str(value)
    if isinstance(value, torch.Generator):
        return "<generator>"  # its state is hidden state, like the global RNG's
    return f"<{type(value).__name__}>"  # opaque objects (process groups, ...): repr has addresses


def _short_hash(text: str) -> str:
    return bytes_digest(text.encode())


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


class Tracer(Observer):
    """Record every aten op (forward and backward) with digests of its inputs and outputs.

    ``start()`` begins tracing on this thread; ``stop()`` ends it and writes the trace to ``path``
    (JSON, atomically) for :func:`compare_traces`. Also a context manager (see :func:`trace`).

    Digests are exact (every byte counts: XXH3-128 of dtype, shape and bytes for dense CPU tensors,
    :func:`torchrepro.fingerprint` for every other kind), computed once per tensor version and
    reused while the tensor is unchanged. In-place and ``out=`` writes are digested after the op
    as outputs; results of ``empty``-like ops, and values computed from them before they are
    overwritten, are recorded as ``uninit`` and never compared as data; non-tensor arguments
    (Python scalars, dtypes, shapes) form one more input. The trace header names the digest
    algorithm, and :func:`compare_traces` refuses to compare traces digested differently.
    ``capture`` (``check --repro``) also saves the inputs of the op at that index of the trace
    (``tracing.capture``).
    """

    _what = "Tracer"

    def __init__(self, path: str | os.PathLike[str], *, capture: CaptureRequest | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self._capture = capture
        """The op call whose inputs to save as well (``check --repro``; ``tracing.capture``)."""
        self._reset()

    def _reset(self) -> None:
        self._value_index: dict[str, int] = {}
        self._op_index: dict[str, int] = {}
        self._site_index: dict[tuple[str | None, str | None], int] = {}
        self._records: list[list[Any]] = []
        self._cache: dict[int, tuple[weakref.ref[torch.Tensor], int, int, int, str]] = {}
        self._epochs: dict[int, int] = {}
        self._tainted: dict[int, weakref.ref[torch.Tensor]] = {}
        self._pending: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        """Received tensors not digested yet: id -> (tensor, its record, its place in the outputs)."""
        self._prune_at = 4096
        self._infos = _OP_INFOS
        self._ops: dict[Any, _TracedOp] = {}

    def start(self) -> None:
        """Start tracing (raises ``TraceError`` if already started)."""
        if self._mode is None:
            self._reset()
        self._start()

    def stop(self) -> Path:
        """Stop tracing, write the trace file and return its path."""
        self._stop()
        try:
            for ref, record, place in list(self._pending.values()):
                t = ref()
                self._resolve(record, place, _PENDING if t is None else _digest(t))
            self._pending.clear()
            self._write()
        finally:
            self._cache.clear()
            self._tainted.clear()
            self._pending.clear()
        return self.path

    def __len__(self) -> int:
        """The number of ops traced so far."""
        return len(self._records)

    # -- file -----------------------------------------------------------------------------------
    def _write(self) -> None:
        rank = group_rank()
        doc = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "torch": torch.__version__,
            "digest": EXACT_DIGEST,
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
    def _token(self, t: torch.Tensor) -> str:
        key = id(t)
        if self._tainted:
            ref = self._tainted.get(key)
            if ref is not None and ref() is t:
                return _UNINIT
        try:
            version = int(t._version)
        except RuntimeError:  # inference tensors keep no version counter: never reuse their digest
            version = -1
        try:
            ptr = int(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # sparse, nested, wrapper subclasses
            ptr = 0
        entry = self._cache.get(key)
        if (
            entry is not None
            and entry[1] == version
            and entry[2] == ptr
            and version >= 0
            and entry[3] == self._epochs.get(ptr, 0)
            and entry[0]() is t
        ):
            return entry[4]
        token = _digest(t)
        self._cache[key] = (weakref.ref(t), version, ptr, self._epochs.get(ptr, 0), token)
        if self._pending:
            pending = self._pending.get(key)
            if pending is not None and pending[0]() is t:  # received: read by the op after the wait
                del self._pending[key]
                self._resolve(pending[1], pending[2], token)
        if len(self._cache) > self._prune_at:
            self._prune()
        return token

    def _resolve(self, record: int, place: int, token: str) -> None:
        """Put the digest of a received tensor in its ``recv`` record's outputs."""
        self._records[record][4][place] = _intern(self._value_index, token)

    def _set_token(self, t: torch.Tensor, token: str) -> str:
        ptr = _storage_ptr(t)
        self._cache[id(t)] = (weakref.ref(t), _version(t), ptr, self._epochs.get(ptr, 0), token)
        return token

    def _prune(self) -> None:
        self._cache = {k: e for k, e in self._cache.items() if e[0]() is not None}
        self._tainted = {k: r for k, r in self._tainted.items() if r() is not None}
        for k, (ref, record, place) in list(self._pending.items()):
            if ref() is None:  # freed unread: never digested
                del self._pending[k]
                self._resolve(record, place, _PENDING)
        self._prune_at = max(4096, 2 * len(self._cache))

    def _outputs(self, values: list[Any], uninit: bool, derived_from: str | None = None) -> list[str]:
        """Tokens of the op's outputs. ``derived_from`` (for view ops) names the outputs by the op and
        its input tokens instead of reading their bytes: a view's values are its input's values."""
        tokens: list[str] = []
        scalars: list[str] = []
        seen: set[int] = set()
        tainted = self._tainted
        for v in values if len(values) == 1 and isinstance(values[0], torch.Tensor) else _leaves(values):
            if isinstance(v, torch.Tensor):
                key = id(v)
                if key in seen:  # an in-place op returns the tensor it wrote
                    continue
                seen.add(key)
                if uninit:
                    tainted[key] = weakref.ref(v)
                    tokens.append(_UNINIT)
                    continue
                if tainted and key in tainted:
                    del tainted[key]
                if derived_from is not None:
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
    def _op(self, func: Any) -> _TracedOp:
        """What this trace knows of ``func`` (its index in the op table, its schema), made once."""
        op = self._ops.get(func)
        if op is None:
            info = self._infos.get(func)
            if info is None:
                info = self._infos[func] = _op_info(func)
            name = self._op_name(func)
            op = self._ops[func] = _TracedOp(
                name=name,
                info=info,
                index=_intern(self._op_index, name),
                skip=name.startswith(IGNORED_NAMESPACES),
                collective=name.startswith(COLLECTIVE_NAMESPACES),
                point_to_point=func._schema.name in _POINT_TO_POINT,
            )
        return op

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        op = self._ops.get(func) or self._op(func)
        if op.skip or self._pause_depth or self._forked or fingerprinting():
            return func(*args, **kwargs)
        info = op.info
        snapshot: Any = None
        with self._lock:
            site = self._sites.attribute(sys._getframe(1), skip_loading=True)
            if site is not None:
                inputs, reads_uninit = self._inputs(info, args, kwargs)
                if self._capture is not None and self._capture.index == len(self._records):
                    snapshot = self._snapshot(op.name, func, args, kwargs)
        if site is None:
            return self._loading_op(func, info, args, kwargs)
        module, location, backward = site
        out = func(*args, **kwargs)
        if op.collective and not op.point_to_point:
            _wait(out)  # an async collective's outputs hold their result only once it completes
        with self._lock:
            written: list[Any] = []
            if info.written:
                written = [_arg(args, kwargs, k) for k in info.written if _has(args, kwargs, k)]
                epochs = self._epochs
                for t in _leaves(written):
                    if isinstance(t, torch.Tensor):
                        ptr = _storage_ptr(t)
                        epochs[ptr] = epochs.get(ptr, 0) + 1
            derived = f"{op.name}|{'|'.join(inputs)}" if info.view else None
            if op.point_to_point:  # received tensors: digested once the caller has waited
                outputs = self._outputs([out], False) + [_PENDING for t in _leaves(written)]
            else:
                outputs = self._outputs([out, *written], info.uninit or reads_uninit, derived)
            where = (module, location)
            values = self._value_index
            if op.point_to_point:
                first = len(outputs) - sum(1 for _ in _leaves(written))
                for place, t in enumerate(_leaves(written), start=first):
                    if isinstance(t, torch.Tensor):
                        self._tainted.pop(id(t), None)  # received whole: no longer uninitialised
                        self._pending[id(t)] = (weakref.ref(t), len(self._records), place)
            self._records.append(
                [
                    op.index,
                    _intern(self._site_index, where),
                    1 if backward else 0,
                    _intern_all(values, inputs),
                    _intern_all(values, outputs),
                    0 if threading.get_ident() == self._thread else 1,
                ]
            )
            if not backward or torch.is_grad_enabled():
                self._sites.remember(out, where)
            if snapshot is not None:
                self._write_capture(snapshot, len(self._records) - 1, inputs)
        return out

    # -- capture (check --repro) ----------------------------------------------------------------
    def _snapshot(self, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The inputs of this call, copied before it runs (or why they cannot be): the op
        ``_capture`` asks for, when it runs on the traced thread."""
        from torchrepro.tracing.capture import Refused, snapshot_call

        if threading.get_ident() != self._thread:
            return "the op ran on another thread than the traced one"
        try:
            return snapshot_call(name, func, args, kwargs)
        except Refused as exc:
            return str(exc)

    def _write_capture(self, snapshot: Any, index: int, inputs: list[str]) -> None:
        from torchrepro.tracing.capture import write_capture

        assert self._capture is not None
        try:
            write_capture(self._capture, snapshot, index=index, inputs=inputs)
        except Exception as exc:  # best effort, like locating: never break the run
            print(f"torchrepro: could not save the op's inputs: {exc}", file=sys.stderr)
        self._capture = None

    def _loading_op(self, func: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run an op of torch's data loading untraced: how many of these run, and when, depends on
        when worker batches arrive. Its writes still invalidate digests of the storages it wrote."""
        out = func(*args, **kwargs)
        if info.written:
            with self._lock:
                epochs = self._epochs
                for key in info.written:
                    if _has(args, kwargs, key):
                        for t in _leaves(_arg(args, kwargs, key)):
                            if isinstance(t, torch.Tensor):
                                ptr = _storage_ptr(t)
                                epochs[ptr] = epochs.get(ptr, 0) + 1
        return out

    def _inputs(self, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[str], bool]:
        """Tokens of the op's inputs (non-tensor arguments last, as one) and whether any is uninit."""
        inputs: list[str] = []
        scalars: list[str] = []
        overwritten = info.overwritten
        items: Any = enumerate(args)
        if kwargs:
            items = [*items, *kwargs.items()]
        for key, value in items:
            if isinstance(value, torch.Tensor):
                inputs.append(_OVERWRITTEN if overwritten and key in overwritten else self._token(value))
            elif isinstance(value, (list, tuple)):
                for v in value:
                    if isinstance(v, torch.Tensor):
                        inputs.append(_OVERWRITTEN if overwritten and key in overwritten else self._token(v))
                    else:
                        scalars.append(_scalar_text(v))
            else:
                scalars.append(_scalar_text(value))
        if scalars:
            inputs.append(_scalar_token(scalars))
        return inputs, _UNINIT in inputs


def _intern(table: dict[Any, int], key: Any) -> int:
    index = table.get(key)
    if index is None:
        index = table[key] = len(table)
    return index


def _intern_all(table: dict[str, int], keys: list[str]) -> list[int]:
    indices = []
    for key in keys:
        index = table.get(key)
        if index is None:
            index = table[key] = len(table)
        indices.append(index)
    return indices


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
