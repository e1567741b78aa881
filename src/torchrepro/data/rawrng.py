"""Global RNG states read and written in place: Python's ``random`` and NumPy's legacy RNG.

This module reads and writes interpreter memory: with ``ctypes`` it copies bytes out of and
back into CPython's ``random.Random`` object and NumPy's ``RandomState`` and ``MT19937`` bit
generator, at addresses it finds itself. ``set_raw_access(False)`` turns that off: every state is
then read and written through the libraries' APIs (``random.getstate``/``setstate``, NumPy's
``get_state``/``set_state``), with the same values, only slower.

``SeededLoader`` saves, checks and puts back these states around every batch it loads in the
main process. Through the libraries' APIs that costs more than loading a light batch
(``random.getstate`` builds a 625-int tuple, ~9 us; NumPy's ``get_state``/``set_state`` 30+ us
each way). Both are Mersenne Twisters kept in C structs, so their bytes are copied instead.

Invariants:
- Memory is read or written only while ``raw_access()`` is true (the default); with it false no
  address is looked up, read or written, and every call goes through the library's API. The
  setting belongs to the process: forked workers inherit it, and a ``SeededLoader``'s dataset
  view carries it into spawned workers.
- A layout is never assumed: it is found once per RNG object by setting known values through
  the library's API, then checked by a full round trip (a raw save, draws that wrap the state, a
  raw restore must give back exactly the state the API reports). Wherever that fails (another
  interpreter, another NumPy, a patched module), the library's own API is used.
- A raw state is only written back into the object it was read from, while raw access is on; a
  state saved from an object that was replaced meanwhile (or saved before raw access was turned
  off) goes back through the API, values intact.
- ``token`` (position, first and last word of the state; Python's also its cached gaussian)
  changes whenever the RNG is seeded or its state is drawn from, at a fraction of a full save.
  NumPy's cached gaussian is left out: a seed clears it, so the first draw after one moves the
  state. A token taken with raw access on never equals one taken with it off.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from typing import Any

__all__ = ["raw_access", "set_raw_access"]

_MT_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], then int pos

_raw_access = True


def set_raw_access(enabled: bool) -> bool:
    """Let ``SeededLoader`` copy the global RNG states of Python and NumPy as raw bytes in memory
    (``True``, the default), or only go through ``random.getstate``/``setstate`` and NumPy's
    ``get_state``/``set_state`` (``False``: no memory is read or written with ``ctypes``; the
    same batches and draws, a few tens of microseconds more per batch). Returns the previous
    setting. It applies to this process, its forked workers and the workers it spawns afterwards.

    >>> previous = set_raw_access(False)
    >>> raw_access()
    False
    >>> set_raw_access(previous)
    False
    """
    global _raw_access
    if not isinstance(enabled, bool):
        raise TypeError(f"set_raw_access expects a bool, got {type(enabled).__name__} {enabled!r}.")
    previous, _raw_access = _raw_access, enabled
    return previous


def raw_access() -> bool:
    """Whether global RNG states may be read and written in memory (see ``set_raw_access``)."""
    return _raw_access


class _RawNumpyState:
    """NumPy's global RNG state as raw bytes: the MT19937 state and the legacy gaussian cache."""

    __slots__ = ("aug", "mt", "owner")

    def __init__(self, owner: Any, mt: bytes, aug: bytes) -> None:
        self.owner, self.mt, self.aug = owner, mt, aug


class _NumpyMT:
    """NumPy's global Mersenne Twister read and written in place (ctypes).

    ``token`` reads its position and first word, about 100x cheaper than ``np.random.get_state()``
    (any draw after seeding changes them). ``save``/``restore`` copy the state as raw bytes
    (0.4 us instead of 30+ us each way through NumPy's API): the MT19937 state struct at the
    bit generator's documented ``ctypes.state_address``, and the legacy ``RandomState``'s cached
    gaussian (``has_gauss``, ``gauss``), whose place in the object is found once per object by
    setting known values through the API, then checked by a full round trip; wherever that
    fails, and while raw access is off, NumPy's own ``get_state``/``set_state`` are used.
    """

    def __init__(self) -> None:
        self.random_state: Any = None
        self.bit_generator: Any = None
        self.words: Any = None
        self.gauss_at: int | None = None  # offset of (int has_gauss, double gauss) in random_state

    def _attach(self, np: Any) -> Any:
        if not _raw_access:
            return None
        random_state = np.random.get_state.__self__  # the RandomState np.random.* draw from
        bit_generator = random_state._bit_generator
        if bit_generator is not self.bit_generator or random_state is not self.random_state:
            self.random_state, self.bit_generator = random_state, bit_generator
            self.words, self.gauss_at = None, None
            try:  # numpy's mt19937_state: uint32 key[624], then int pos
                address = bit_generator.ctypes.state_address
                if type(bit_generator).__name__ == "MT19937" and isinstance(address, int):
                    self.words = (ctypes.c_uint32 * 625).from_address(address)
            except (AttributeError, TypeError, ValueError):
                self.words = None
            if self.words is not None:
                self.gauss_at = self._find_gauss(random_state)
        return self.words

    def token(self, np: Any) -> Any:
        words = self._attach(np)
        if words is None:
            state = np.random.get_state()
            return (int(state[2]), state[1].tobytes(), state[3])
        return (words[624], words[0], words[623])

    def save(self, np: Any) -> Any:
        """The global state, for ``restore``."""
        if self._attach(np) is None or self.gauss_at is None:
            return np.random.get_state()
        return self._raw(self.gauss_at)

    def restore(self, np: Any, saved: Any) -> None:
        if not isinstance(saved, _RawNumpyState):
            np.random.set_state(saved)
        elif self._attach(np) is not None and self.gauss_at is not None and saved.owner is self.random_state:
            self._write(saved, self.gauss_at)
        else:  # the global RandomState was replaced meanwhile: put the values back through the API
            key = np.frombuffer(saved.mt[:-4], dtype=np.uint32).copy()
            pos = int.from_bytes(saved.mt[-4:], sys.byteorder, signed=True)
            has_gauss = int.from_bytes(saved.aug[:4], sys.byteorder, signed=True)
            (gauss,) = struct.unpack("=d", saved.aug[8:16])
            np.random.set_state(("MT19937", key, pos, has_gauss, gauss))

    def _raw(self, gauss_at: int) -> _RawNumpyState:
        owner = self.random_state
        mt = ctypes.string_at(ctypes.addressof(self.words), _MT_STATE_BYTES)
        return _RawNumpyState(owner, mt, ctypes.string_at(id(owner) + gauss_at, 16))

    def _write(self, saved: _RawNumpyState, gauss_at: int) -> None:
        ctypes.memmove(ctypes.addressof(self.words), saved.mt, _MT_STATE_BYTES)
        ctypes.memmove(id(saved.owner) + gauss_at, saved.aug, 16)

    def _find_gauss(self, random_state: Any) -> int | None:
        """Where ``random_state`` keeps ``int has_gauss`` (then ``double gauss``, 8 bytes on), or
        None. Found by setting two known pairs through NumPy's API, then a raw save, draws and a raw
        restore must give back exactly the state NumPy reports; the state is put back either way."""
        try:
            saved = random_state.get_state(legacy=True)
            size = type(random_state).__basicsize__
        except (AttributeError, TypeError, ValueError):
            return None
        try:
            found = -1
            for has_gauss, gauss in ((1, 0.12345678901234568), (0, -0.0027182818284590454)):
                random_state.set_state((saved[0], saved[1], saved[2], has_gauss, gauss))
                raw = ctypes.string_at(id(random_state), size)
                value = struct.pack("=d", gauss)
                at = raw.find(value)
                if at < 8 or at % 8 or raw.find(value, at + 1) != -1:
                    return None
                if int.from_bytes(raw[at - 8 : at - 4], sys.byteorder, signed=True) != has_gauss:
                    return None
                if found not in (-1, at - 8):
                    return None
                found = at - 8
            random_state.set_state((saved[0], saved[1], saved[2], 1, 0.5))
            before = random_state.get_state(legacy=True)
            raw_state = self._raw(found)
            random_state.standard_normal(3)  # moves the key and position, caches another gaussian
            random_state.randint(0, 1 << 30, size=700)  # wraps the 624-word state
            self._write(raw_state, found)
            after = random_state.get_state(legacy=True)
            same = (
                before[0] == after[0]
                and before[1].tobytes() == after[1].tobytes()
                and tuple(before[2:]) == tuple(after[2:])
            )
            return found if same else None
        except Exception:  # an unexpected layout: NumPy's API it is
            return None
        finally:
            random_state.set_state(saved)


numpy_mt = _NumpyMT()


_PY_BYTES = 4 + 624 * 4  # CPython's RandomObject: int index, then uint32_t state[624]
_PROBE_WORDS = tuple((i * 2654435761 + 0x5EED) & 0xFFFFFFFF for i in range(624))
_PROBE_INDEX = 17


class _RawPythonState:
    """Python's global RNG state as raw bytes (index and MT19937 state) and ``gauss_next``."""

    __slots__ = ("gauss_next", "mt", "owner")

    def __init__(self, owner: Any, mt: bytes, gauss_next: Any) -> None:
        self.owner, self.mt, self.gauss_next = owner, mt, gauss_next


class _PythonMT:
    """Python's global Mersenne Twister (the ``random.Random`` the module's functions are bound
    to) read and written in place (ctypes).

    CPython keeps ``int index`` then ``uint32_t state[624]`` in the object; ``gauss()``'s cached
    value is the attribute ``gauss_next``. Where ``index`` lies is found once per type on a fresh
    instance (a state of known words set through ``setstate`` and located in its bytes, then a
    round trip checked), and checked against the global object's ``getstate()`` read-only.
    ``save``/``restore`` cost ~0.5 us instead of ``getstate``/``setstate``'s ~11 us (a
    625-int tuple built and parsed), ``token`` ~0.2 us. Wherever the layout is not found, and
    while raw access is off, ``random.getstate``/``setstate`` are used.
    """

    def __init__(self) -> None:
        self.inst: Any = None
        self.words: Any = None  # ctypes uint32[625] over (index, state) of self.inst
        self.offsets: dict[type, int | None] = {}

    def _attach(self) -> Any:
        if not _raw_access:
            return None
        inst = getattr(random.random, "__self__", None)
        if inst is not self.inst:
            self.inst, self.words = inst, None
            if type(inst) is random.Random and getattr(random.getstate, "__self__", None) is inst:
                self.words = self._view(inst)
        return self.words

    def token(self) -> Any:
        words = self._attach()
        if words is None:
            return random.getstate()
        return (words[0], words[1], words[624], self.inst.gauss_next)

    def save(self) -> Any:
        """The global state, for ``restore``."""
        words = self._attach()
        if words is None:
            return random.getstate()
        inst = self.inst
        return _RawPythonState(inst, ctypes.string_at(ctypes.addressof(words), _PY_BYTES), inst.gauss_next)

    def restore(self, saved: Any) -> None:
        if not isinstance(saved, _RawPythonState):
            random.setstate(saved)
        elif self._attach() is not None and saved.owner is self.inst:
            ctypes.memmove(ctypes.addressof(self.words), saved.mt, _PY_BYTES)
            self.inst.gauss_next = saved.gauss_next
        else:  # the global Random was replaced meanwhile: put the values back through the API
            index = int.from_bytes(saved.mt[:4], sys.byteorder, signed=True)
            words = struct.unpack("=624I", saved.mt[4:])
            random.setstate((3, (*words, index), saved.gauss_next))

    def _view(self, inst: Any) -> Any:
        cls = type(inst)
        if cls not in self.offsets:
            self.offsets[cls] = self._find(cls)
        offset = self.offsets[cls]
        if offset is None:
            return None
        words = (ctypes.c_uint32 * 625).from_address(id(inst) + offset)
        try:
            state = inst.getstate()[1]
        except Exception:  # an unexpected getstate: the API it is
            return None
        same = words[0] == state[-1] and tuple(words[1:]) == state[:-1]
        return words if same else None

    @staticmethod
    def _find(cls: type) -> int | None:
        """Where instances of ``cls`` keep ``int index`` (``state[624]`` 4 bytes on), or None."""
        try:
            probe = cls()
            probe.setstate((3, (*_PROBE_WORDS, _PROBE_INDEX), None))
            raw = ctypes.string_at(id(probe), cls.__basicsize__)
            pattern = struct.pack("=624I", *_PROBE_WORDS)
            at = raw.find(pattern)
            if at < 4 or at % 4 or raw.find(pattern, at + 1) != -1:
                return None
            if int.from_bytes(raw[at - 4 : at], sys.byteorder, signed=True) != _PROBE_INDEX:
                return None
            offset = at - 4
            before = probe.getstate()
            saved = ctypes.string_at(id(probe) + offset, _PY_BYTES)
            probe.gauss(0.0, 1.0)  # moves the state and caches a gaussian
            probe.getrandbits(32 * 700)  # wraps the 624-word state
            ctypes.memmove(id(probe) + offset, saved, _PY_BYTES)
            probe.gauss_next = before[2]
            return offset if probe.getstate() == before else None
        except Exception:  # an unexpected layout or type: the API it is
            return None


_python_mt = _PythonMT()
