"""Fingerprints: one digest for tensors, modules, optimizers, state dicts and nested containers.

Invariants:
- ``fingerprint(obj)`` is a 32-character hex string (128-bit BLAKE2b) that depends only on the
  *value*: dtype, shape and the bytes of every tensor in row-major order, the structure and the
  plain values of containers. It is the same in any process, for any memory layout (views,
  non-contiguous, other strides, conjugate/negative views), and on any device of a little-endian
  host; it changes when any single bit, the order of elements, a dtype or a shape changes.
- A module hashes as its ``state_dict()`` (parameters and persistent buffers), an optimizer or any
  other object with a ``state_dict()`` method as that state dict; dicts are hashed independently
  of insertion order, lists and tuples as the same ordered sequence.
- Large tensors are hashed where they live, with torch integer ops in bounded chunks: the bytes
  are read as 64-bit words, each word is mixed with its position (multiply-xorshift, wrapping
  int64 arithmetic) and the mixed words are summed exactly. Integer sums do not depend on order,
  so the digest is the same on every device and for every chunking; only a few reduced numbers
  leave the device. On the CPU the chunks are large enough (1 MiB of words) for torch's own
  intra-op threads to share each op, which scales where splitting the words among Python threads
  did not (each op's Python call holds the GIL); integer sums do not depend on how the threads
  split them either. On a busy machine one thread is faster than torch's: each large tensor is
  hashed with the count measured faster so far (``_ThreadChoice``). Small tensors take a fast
  path over their bytes with ``hashlib``.
- Nothing here changes global torch state; unsupported objects raise ``TypeError`` naming the
  type and where it sits inside the container.
- This is the one tensor-hashing module: ``exact_digest`` (op traces) and the checkpoint
  checksums read tensor bytes through ``byte_view``. ``exact_digest`` hashes them in one pass with
  XXH3-128 (the required ``xxhash`` package, imported on first use); the checkpoint checksums hash
  large ones in fixed-size chunks on the one thread pool of ``parallel_map`` (one per process; a
  forked child makes its own). No digest depends on the number of threads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import math
import os
import reprlib
import struct
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

__all__ = ["fingerprint", "fingerprinting"]

#: Tensors of at most this many bytes are hashed with hashlib over their bytes (on the host).
SMALL_TENSOR_BYTES = 1 << 16
#: Words (int64) processed per chunk on the CPU and elsewhere. A CPU chunk spans several of torch's
#: parallel grains (32768 elements), so every op runs on the intra-op threads; smaller chunks pay
#: more per-op Python calls, larger ones leave the cache (benchmarks/fingerprint_speed.py).
_CPU_CHUNK_WORDS = 1 << 17
_DEVICE_CHUNK_WORDS = 1 << 22

_DIGEST_BYTES = 16
_T = TypeVar("_T")
_R = TypeVar("_R")
_FORMAT = b"torchrepro.fingerprint.v1"


def _signed(c: int) -> int:
    """The int64 that has the bits of the 64-bit unsigned constant ``c``."""
    return c - (1 << 64) if c >= 1 << 63 else c


# Odd 64-bit multipliers (golden ratio and the splitmix64 finaliser constants).
_K_POS = _signed(0x9E3779B97F4A7C15)
_C1 = _signed(0xBF58476D1CE4E5B9)
_C2 = _signed(0x94D049BB133111EB)
_MASK32 = (1 << 32) - 1
_MASK35 = (1 << 35) - 1


class _Depth(threading.local):
    depth = 0  # a class default: reading it is cheap in every thread (op recorders ask on every op)


_active = _Depth()


def fingerprinting() -> bool:
    """Whether this thread is inside ``fingerprint`` (op recorders ignore the ops it runs)."""
    return _active.depth > 0


def fingerprint(obj: Any) -> str:
    """Return a 32-character hex digest of ``obj``'s value, stable across processes and layouts.

    Accepts tensors of every dtype (dense, sparse, quantized), ``nn.Module`` (its state dict,
    buffers included), optimizers, schedulers and other objects with a ``state_dict()`` method,
    NumPy arrays and scalars, dataclasses, and nested dicts, lists, tuples and sets of these plus
    numbers, strings, bytes and ``None``. A NumPy array hashes like the equal torch tensor.

    >>> import torch
    >>> t = torch.arange(6.0).reshape(2, 3)
    >>> fingerprint(t) == fingerprint(t.t().contiguous().t())  # layout does not matter
    True
    >>> fingerprint(t) == fingerprint(t.reshape(3, 2))  # shape does
    False
    >>> len(fingerprint({"w": t, "step": 3}))
    32
    """
    _active.depth += 1
    try:
        if type(obj) in _PLAIN_TENSORS:
            small = _small_digest(obj)
            if small is not None:
                return small.hex()
        return _Hasher().digest(obj, "obj").hex()
    finally:
        _active.depth -= 1


_BLAKE = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"torchrepro")  # copied: 3x cheaper than new


def _absorb(h: hashlib.blake2b, *parts: bytes) -> hashlib.blake2b:
    """``h`` after each part, preceded by its length (the encoding of every digest here)."""
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h


def _blake(*parts: bytes) -> bytes:
    return _absorb(_BLAKE.copy(), *parts).digest()


def fingerprint_texts(head: str, texts: Sequence[str]) -> str:
    """``fingerprint([head, list(texts)])`` for strings, without the general traversal (the
    recorder digests every event this way: a skeleton and the fingerprints of its tensors)."""

    def text(value: str) -> bytes:
        return _blake(b"str", value.encode("utf-8", "surrogatepass"))

    inner = _blake(b"seq", len(texts).to_bytes(8, "little"), *map(text, texts))
    return _blake(b"seq", (2).to_bytes(8, "little"), text(head), inner).hex()


def _int_bytes(n: int) -> bytes:
    return n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)


class _Hasher:
    """One traversal of an object; tracks the containers on the current path to catch cycles."""

    def __init__(self) -> None:
        self._stack: set[int] = set()

    def digest(self, obj: Any, path: str) -> bytes:
        if obj is None:
            return _blake(b"none")
        if isinstance(obj, bool):
            return _blake(b"bool", b"1" if obj else b"0")
        if isinstance(obj, int):
            return _blake(b"int", _int_bytes(int(obj)))
        if isinstance(obj, float):
            return _blake(b"float", struct.pack("<d", obj))
        if isinstance(obj, complex):
            return _blake(b"complex", struct.pack("<dd", obj.real, obj.imag))
        if isinstance(obj, str):
            return _blake(b"str", obj.encode("utf-8", "surrogatepass"))
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return _blake(b"bytes", bytes(obj))
        if isinstance(obj, torch.Tensor):
            return _tensor_digest(obj, path)
        if isinstance(obj, torch.dtype):
            return _blake(b"dtype", str(obj).encode())
        if isinstance(obj, torch.device):
            return _blake(b"device", str(obj).encode())
        if _is_numpy(obj):
            return _numpy_digest(obj, path)
        if isinstance(obj, torch.nn.Module):
            return self._nested(obj, path, lambda: self.digest(obj.state_dict(keep_vars=True), path))
        if isinstance(obj, Mapping):
            return self._nested(obj, path, lambda: self._mapping(obj, path))
        if isinstance(obj, (list, tuple)):
            return self._nested(obj, path, lambda: self._sequence(obj, path))
        if isinstance(obj, Set):
            return self._nested(obj, path, lambda: self._set(obj, path))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return self._nested(obj, path, lambda: self._dataclass(obj, path))
        state_dict = getattr(obj, "state_dict", None)
        if callable(state_dict) and not isinstance(obj, type):
            return self._nested(obj, path, lambda: self.digest(state_dict(), f"{path}.state_dict()"))
        raise TypeError(
            f"fingerprint() cannot hash an object of type {_type_name(obj)} at {path} "
            f"({reprlib.repr(obj)}). Supported: "
            "tensors, modules, optimizers and other objects with a state_dict() method, NumPy arrays, "
            "dataclasses, dicts, lists, tuples and sets of these, numbers, strings, bytes and None; "
            "convert the object to one of these first (for example a tensor or a dict)."
        )

    def _nested(self, obj: Any, path: str, compute: Callable[[], bytes]) -> bytes:
        key = id(obj)
        if key in self._stack:
            raise ValueError(f"fingerprint() found a reference cycle: {path} contains itself")
        self._stack.add(key)
        try:
            return compute()
        finally:
            self._stack.discard(key)

    def _mapping(self, obj: Mapping[Any, Any], path: str) -> bytes:
        items = sorted(
            self.digest(k, f"{path} key {k!r}") + self.digest(v, f"{path}[{k!r}]") for k, v in obj.items()
        )
        return _blake(b"map", len(items).to_bytes(8, "little"), *items)

    def _sequence(self, obj: list[Any] | tuple[Any, ...], path: str) -> bytes:
        return _blake(
            b"seq",
            len(obj).to_bytes(8, "little"),
            *(self.digest(v, f"{path}[{i}]") for i, v in enumerate(obj)),
        )

    def _set(self, obj: Set[Any], path: str) -> bytes:
        return _blake(b"set", *sorted(self.digest(v, f"{path} element {v!r}") for v in obj))

    def _dataclass(self, obj: Any, path: str) -> bytes:
        cls = type(obj)
        parts = [f"{cls.__module__}.{cls.__qualname__}".encode()]
        for f in dataclasses.fields(obj):
            parts += [f.name.encode(), self.digest(getattr(obj, f.name), f"{path}.{f.name}")]
        return _blake(b"dataclass", *parts)


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _is_numpy(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, (np.ndarray, np.generic))


# --- tensors -------------------------------------------------------------------------------------


def _header(kind: bytes, dtype: str, shape: tuple[int, ...]) -> bytes:
    return _FORMAT + b"|" + kind + b"|" + dtype.encode() + b"|" + ",".join(map(str, shape)).encode()


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


_SMALL_HEADS: dict[tuple[torch.dtype, tuple[int, ...]], hashlib.blake2b] = {}
"""(dtype, shape) -> the hash state of ``_blake(header, b"small", sha256)`` before the SHA-256."""


def _small_digest(t: torch.Tensor) -> bytes | None:
    """The digest of a small dense contiguous CPU tensor (the common case: no views, one copy of
    the bytes, the header's hash state cached per dtype and shape), or None for any other tensor.
    Equal to ``_blake(_header(...), b"small", sha256(bytes))``, the general path's value."""
    if not (
        t.layout == torch.strided
        and t.is_cpu
        and not (t.is_quantized or t.is_nested or t.is_conj() or t.is_neg())
        and t.is_contiguous()
    ):
        return None
    n = t.numel() * t.element_size()
    if n > SMALL_TENSOR_BYTES:
        return None
    key = (t.dtype, t.shape)
    head = _SMALL_HEADS.get(key)
    if head is None:
        if len(_SMALL_HEADS) >= 4096:  # shapes that keep changing: bounded, rebuilt on demand
            _SMALL_HEADS.clear()
        head = _absorb(_BLAKE.copy(), _header(b"tensor", str(t.dtype), tuple(t.shape)), b"small")
        _SMALL_HEADS[key] = head
    return _absorb(head.copy(), hashlib.sha256(_host_bytes(t)).digest()).digest()


def _tensor_digest(t: torch.Tensor, path: str) -> bytes:
    if type(t) in _PLAIN_TENSORS:
        small = _small_digest(t)
        if small is not None:
            return small
    t = t.detach()
    if t.device.type == "meta" or _is_fake(t):
        raise TypeError(
            f"fingerprint() cannot hash the {t.device.type} tensor at {path}: it holds no data. "
            "Fingerprint a tensor with materialised values."
        )
    if t.is_nested:
        return _blake(b"nested", *(_tensor_digest(x, f"{path}[{i}]") for i, x in enumerate(t.unbind())))
    layout = t.layout
    if layout == torch.sparse_coo:
        c = t.coalesce()
        return _blake(
            _header(b"sparse_coo", str(t.dtype), tuple(t.shape)),
            _tensor_digest(c.indices(), f"{path}.indices()"),
            _tensor_digest(c.values(), f"{path}.values()"),
        )
    if layout in _COMPRESSED:
        outer, inner = _COMPRESSED[layout]
        return _blake(
            _header(str(layout).encode(), str(t.dtype), tuple(t.shape)),
            _tensor_digest(getattr(t, outer)(), f"{path}.{outer}()"),
            _tensor_digest(getattr(t, inner)(), f"{path}.{inner}()"),
            _tensor_digest(t.values(), f"{path}.values()"),
        )
    if layout != torch.strided:
        raise TypeError(f"fingerprint() cannot hash the tensor at {path}: layout {layout} is not supported.")
    if t.is_quantized:
        return _quantized_digest(t, path)
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return _dense_digest(t, _header(b"tensor", str(t.dtype), tuple(t.shape)), path)


_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"


def _quantized_digest(t: torch.Tensor, path: str) -> bytes:
    scheme = t.qscheme()
    parts = [_header(b"quantized", str(t.dtype), tuple(t.shape)), str(scheme).encode()]
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        parts += [struct.pack("<d", t.q_scale()), _int_bytes(t.q_zero_point())]
    elif scheme in (
        torch.per_channel_affine,
        torch.per_channel_symmetric,
        torch.per_channel_affine_float_qparams,
    ):
        parts += [
            _int_bytes(t.q_per_channel_axis()),
            _tensor_digest(t.q_per_channel_scales(), f"{path}.q_per_channel_scales()"),
            _tensor_digest(t.q_per_channel_zero_points(), f"{path}.q_per_channel_zero_points()"),
        ]
    else:
        raise TypeError(f"fingerprint() cannot hash the quantized tensor at {path}: qscheme {scheme}.")
    parts.append(_tensor_digest(t.int_repr(), f"{path}.int_repr()"))
    return _blake(b"quantized", *parts)


def _dense_digest(t: torch.Tensor, header: bytes, path: str) -> bytes:
    try:
        words = _as_integers(t)
        nbytes = words.numel() * words.element_size()
        if nbytes <= SMALL_TENSOR_BYTES:
            return _blake(header, b"small", _small_bytes_digest(words))
        return _blake(header, b"words", _word_digest(words))
    except RuntimeError as exc:  # a dtype or tensor kind torch cannot view as bytes
        raise TypeError(
            f"fingerprint() cannot read the bytes of the {t.dtype} tensor at {path}: {exc}"
        ) from None


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_integers(t: torch.Tensor) -> torch.Tensor:
    """The same bytes, in the same row-major order, as a plain integer tensor (a view, never a copy).

    Copies, concatenations and reductions then run on integer kernels, which exist for every device,
    whatever the original dtype (complex32, float8 and ``bits`` dtypes have few kernels).
    """
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()])


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D tensor with stride 1 (copied on its device only if it is not contiguous)."""
    t = t.contiguous()
    n = t.numel()
    flat = t.reshape(-1)
    if n and flat.stride(0) != 1:  # contiguous tensors with size-1 dims may carry odd strides
        flat = flat.as_strided((n,), (1,))
    return flat


def _host_bytes(t: torch.Tensor) -> bytes:
    """A copy of the bytes of a small contiguous CPU tensor."""
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def _small_bytes_digest(t: torch.Tensor) -> bytes:
    if t.device.type != "cpu":
        t = t.to("cpu")
    flat = _flat(t)
    return hashlib.sha256(_host_bytes(flat)).digest()


def _byte_pieces(t: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """1-D contiguous uint8 pieces of ``t``'s bytes in row-major order, each at most about ``max_bytes``.

    Only non-contiguous tensors are copied, a bounded piece at a time, on their own device.
    """
    if t.is_contiguous():
        flat = _flat(t).view(torch.uint8)
        for start in range(0, flat.numel(), max_bytes):
            yield flat[start : start + max_bytes]
        return
    rows = t.shape[0]
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    if row_bytes >= max_bytes:
        for i in range(rows):
            yield from _byte_pieces(t[i], max_bytes)
        return
    step = max(1, max_bytes // max(row_bytes, 1))
    for start in range(0, rows, step):
        yield _flat(t[start : start + step]).view(torch.uint8)


def _as_words(piece: torch.Tensor) -> torch.Tensor:
    """View a uint8 piece whose length is a multiple of 8 as int64 words (copying if misaligned)."""
    if piece.storage_offset() % 8 != 0:
        piece = piece.clone()
    return piece.view(torch.int64)


class _Scratch(threading.local):
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


_cpu_scratch = _Scratch()  # at most 4 x _CPU_CHUNK_WORDS words (4 MiB) per thread that hashes


class _WordMixer:
    """Accumulates two 64-bit lanes over position-keyed, mixed int64 words, on one device.

    For word ``w`` at absolute word index ``i``: ``k = i * K``; ``x = mix(w ^ k)`` with two
    multiply-xorshift rounds (a bijection of ``w`` for each ``i``, so one changed word always
    changes lane A); lane A sums ``x``, lane B sums ``x * k``. Both sums wrap modulo 2**64.
    """

    def __init__(self, device: torch.device, chunk: int) -> None:
        self.device = device
        self.chunk = chunk
        self.position = 0
        self.lane_a = torch.zeros((), dtype=torch.int64, device=device)
        self.lane_b = torch.zeros((), dtype=torch.int64, device=device)
        self._bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The position keys ``arange * K`` and three scratch buffers, ``n`` words each.

        On the CPU they are kept per thread between calls: allocating them and touching their
        fresh pages cost more than mixing a tensor of a few MiB."""
        bufs = self._bufs
        if bufs is None or bufs[0].numel() < n:
            size = min(max(n, 1), self.chunk)
            on_cpu = self.device.type == "cpu"
            kept = _cpu_scratch.buffers if on_cpu else None
            if kept is not None and kept[0].numel() >= size:
                bufs = kept
            else:

                def scratch() -> torch.Tensor:
                    return torch.empty(size, dtype=torch.int64, device=self.device)

                base = torch.arange(size, dtype=torch.int64, device=self.device).mul_(_K_POS)
                bufs = (base, scratch(), scratch(), scratch())
                if on_cpu:
                    _cpu_scratch.buffers = bufs
            self._bufs = bufs
        base, key, x, tmp = bufs
        return base[:n], key[:n], x[:n], tmp[:n]

    def update(self, words: torch.Tensor) -> None:
        for start in range(0, words.numel(), self.chunk):
            w = words[start : start + self.chunk]
            n = w.numel()
            base, key, x, tmp = self._buffers(n)
            torch.add(base, _signed((self.position * _K_POS) % (1 << 64)), out=key)
            torch.bitwise_xor(w, key, out=x)
            x.mul_(_C1)
            torch.bitwise_right_shift(x, 32, out=tmp)
            x.bitwise_xor_(tmp.bitwise_and_(_MASK32))
            x.mul_(_C2)
            torch.bitwise_right_shift(x, 29, out=tmp)
            x.bitwise_xor_(tmp.bitwise_and_(_MASK35))
            self.lane_a.add_(x.sum())
            self.lane_b.add_(key.mul_(x).sum())
            self.position += n


#: A CPU tensor of at least this many bytes has its hashing timed, for the choice of threads.
_TIMED_BYTES = 1 << 22


class _ThreadChoice:
    """How many intra-op threads hash a large CPU tensor: torch's setting, or one.

    Every op of a chunk is a parallel region that ends when its slowest thread does. On a machine
    whose cores are busy (DataLoader workers, other jobs) torch's threads are descheduled in turn
    and each of the ten ops of every chunk waits for one: measured on 2 cores with two busy
    processes, 2 threads hashed at 0.05-0.5 GB/s where one thread kept 1-3 GB/s. So each large
    tensor's throughput is measured under the count it used, and the faster count is used next;
    the other is tried again every ``_RETRY`` large tensors (a machine that quiets down gets its
    threads back). The digest does not depend on the count (integer sums): only the speed does.
    """

    _RETRY = 16

    def __init__(self) -> None:
        self.rate: dict[int, float] = {}  # threads -> bytes/s, a running mean
        self.calls = 0
        self.lock = threading.Lock()

    def pick(self, threads: int) -> int:
        if threads <= 1:
            return threads
        with self.lock:
            self.calls += 1
            known = {n: r for n, r in self.rate.items() if n in (1, threads)}
            if len(known) < 2:
                return 1 if threads in known else threads  # measure both first
            best = max(known, key=known.__getitem__)
            if self.calls % self._RETRY == 0:
                return 1 if best == threads else threads
            return best

    def record(self, threads: int, nbytes: int, seconds: float) -> None:
        if seconds <= 0:
            return
        with self.lock:
            new = nbytes / seconds
            old = self.rate.get(threads)
            self.rate[threads] = new if old is None else (old + new) / 2


_thread_choice = _ThreadChoice()


def _word_digest(t: torch.Tensor) -> bytes:
    """The words' digest; a large CPU tensor with the faster of torch's thread count and one."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < _TIMED_BYTES:
        return _mix_words(t)
    threads = torch.get_num_threads()
    use = _thread_choice.pick(threads)
    if use != threads:
        torch.set_num_threads(use)
    start = time.perf_counter()
    try:
        return _mix_words(t)
    finally:
        _thread_choice.record(use, nbytes, time.perf_counter() - start)
        if use != threads:
            torch.set_num_threads(threads)


def _mix_words(t: torch.Tensor) -> bytes:
    on_cpu = t.device.type == "cpu"
    chunk = _CPU_CHUNK_WORDS if on_cpu else _DEVICE_CHUNK_WORDS
    mixer = _WordMixer(t.device, chunk)
    carry: torch.Tensor | None = None
    for piece in _byte_pieces(t, chunk * 8):
        if carry is not None and carry.numel():
            piece = torch.cat([carry, piece])
        aligned = piece.numel() // 8 * 8
        if aligned:
            mixer.update(_as_words(piece[:aligned]))
        carry = piece[aligned:]
    tail = b""
    if carry is not None and carry.numel():
        tail = bytes(carry.to("cpu").tolist())
    lanes = torch.stack([mixer.lane_a, mixer.lane_b]).to("cpu").tolist()
    return struct.pack("<qqq", mixer.position, *lanes) + tail


def _numpy_digest(arr: Any, path: str) -> bytes:
    import numpy as np

    arr = np.asarray(arr)
    if arr.dtype.kind == "O":
        raise TypeError(
            f"fingerprint() cannot hash the NumPy object array at {path}: its elements are Python "
            "objects; convert it to a list or to a numeric array first."
        )
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if any(s < 0 for s in arr.strides):
        arr = np.ascontiguousarray(arr)
    try:
        tensor_dtype = torch.from_numpy(np.empty(0, dtype=arr.dtype)).dtype
    except TypeError:
        tensor_dtype = None
    if tensor_dtype is None:  # strings, datetimes, records: hash the raw bytes with the NumPy dtype
        data = np.ascontiguousarray(arr)
        return _blake(_header(b"ndarray", data.dtype.str, tuple(data.shape)), data.tobytes())
    with warnings.catch_warnings():  # read-only arrays warn that the tensor would share them
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(arr)
    return _tensor_digest(tensor, path)


# --------------------------------------------------------------------------------------------
# Raw bytes: zero-copy views and chunked hashing on one thread pool


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_DIGEST_CHUNK_BYTES = 1 << 20
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def parallel_map(fn: Callable[[_T], _R], pieces: Sequence[_T]) -> list[_R]:
    """``[fn(p) for p in pieces]``, on the hashing thread pool (hashlib, zlib and torch's kernels
    release the GIL)."""
    global _pool, _pool_pid
    if len(pieces) < 2 or (os.cpu_count() or 1) < 2:
        return [fn(p) for p in pieces]
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="torchrepro-hash"
        )
        _pool_pid = os.getpid()
    return list(_pool.map(fn, pieces))


def chunks(data: memoryview, size: int = _DIGEST_CHUNK_BYTES) -> list[memoryview]:
    """``data`` in pieces of ``size`` bytes (the last one shorter)."""
    return [data[i : i + size] for i in range(0, len(data), size)]


#: The algorithm of :func:`exact_digest` (written into every op trace, which compares only
#: traces hashed alike): XXH3-128 over a header and the raw bytes.
EXACT_DIGEST = "xxh3_128"

# Tensors of at most this many bytes are copied and hashed in one call (cheaper than streaming).
_COPY_BYTES = 1 << 12
_xxh3_128: Any = None
_xxh3_128_hex: Any = None


def _load_xxh3() -> Any:
    global _xxh3_128, _xxh3_128_hex
    try:
        import xxhash
    except ImportError:
        raise ImportError(
            "torchrepro's op traces hash tensors with XXH3-128 from the xxhash package, which is not "
            "installed; install it with `pip install 'xxhash>=3.0'` (or reinstall torchrepro)."
        ) from None
    _xxh3_128, _xxh3_128_hex = xxhash.xxh3_128, xxhash.xxh3_128_hexdigest
    return _xxh3_128


def _load_xxh3_hex() -> Any:
    _load_xxh3()
    return _xxh3_128_hex


def bytes_digest(data: bytes) -> str:
    """XXH3-128 (:data:`EXACT_DIGEST`) of ``data``, as 32 hex characters."""
    return str((_xxh3_128_hex or _load_xxh3_hex())(data))


# Headers of exact digests by (dtype, shape): formatting them costs more than hashing small tensors.
_HEADERS: dict[tuple[torch.dtype, torch.Size], bytes] = {}
_MAX_HEADERS = 1 << 14


def exact_digest(t: torch.Tensor) -> str:
    """An exact digest of ``t``'s value (dtype, shape, every byte in row-major order).

    Dense CPU tensors are hashed in place with XXH3-128 (:data:`EXACT_DIGEST`) over a header
    (dtype and shape) and their raw bytes, near memory bandwidth and without temporaries; every
    other kind goes to :func:`fingerprint`, which handles devices, layouts and odd dtypes.
    """
    if (
        type(t) in _PLAIN_TENSOR_TYPES
        and t.is_cpu
        and t.layout == torch.strided
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg() or t.is_quantized)
    ):
        key = (t.dtype, t.shape)
        header = _HEADERS.get(key)
        if header is None:
            if len(_HEADERS) >= _MAX_HEADERS:
                _HEADERS.clear()
            header = _HEADERS[key] = f"{t.dtype}{tuple(t.shape)}".encode()
        n = t.nbytes
        if n <= _COPY_BYTES:  # one call over a copy (the same digest as streaming the two parts)
            return str((_xxh3_128_hex or _load_xxh3_hex())(header + ctypes.string_at(t.data_ptr(), n)))
        h = (_xxh3_128 or _load_xxh3())(header)
        h.update((ctypes.c_ubyte * n).from_address(t.data_ptr()))
        return str(h.hexdigest())
    try:
        return fingerprint(t)
    except (TypeError, ValueError):  # meta/fake tensors and other kinds without readable values
        return f"opaque:{t.dtype}:{tuple(t.shape)}:{t.device.type}"
