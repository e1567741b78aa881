"""Seeds: one derivation for every child seed, and one call that seeds every RNG.

Invariants:
- ``derive_seed`` is pure and platform independent (BLAKE2b over an unambiguous, typed encoding
  of the keys; never Python's ``hash()``), so every process derives the same child seeds.
- Every library gets its own derived seed: distinct user seeds give distinct streams everywhere,
  and NumPy's 32-bit seed limit never truncates a 64-bit user seed.
- ``Deriver`` (the loader's per-sample derivation: ``derive_seed`` for a fixed key prefix, from
  a copied hash state) gives exactly ``derive_seed``'s values: both start the hash in one place
  and encode int keys with the same headers.
- This module owns every write of the global RNG streams: ``seed_everything`` (and
  ``seed_streams``, the same streams without queueing seeds for an idle CUDA) seed each library
  from its derived seed; ``sample_seeder`` is the per-sample seeder of ``SeededLoader``.
"""

from __future__ import annotations

import hashlib
import os
import random
import struct
from _random import Random as _CRandom
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from torchrepro._compat import lazy_import, numpy_or_none
from torchrepro._runtime import cuda_started

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")  # imported on first use: derive_seed and validate_seed need none

__all__ = [
    "MAX_SEED",
    "current_seed",
    "derive_seed",
    "sample_seeder",
    "seed_everything",
    "seed_streams",
    "validate_seed",
]

MAX_SEED = 2**64 - 1
"""The largest seed accepted anywhere (seeds are unsigned 64-bit integers)."""

_current_seed: int | None = None
_PERSON = b"torchrepro.seed1"  # BLAKE2b personalisation: changes only with the derivation itself


def validate_seed(seed: object, name: str = "seed") -> int:
    """Return ``seed`` as an int if it is a valid seed, else raise ``TypeError``/``ValueError``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"{name} must be an int in [0, 2**64 - 1], got {type(seed).__name__} {seed!r}; "
            f"pass an integer such as {name}=0."
        )
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be in [0, 2**64 - 1] (0 <= {name} <= {MAX_SEED}), got {seed}.")
    return int(seed)


_pack_u32 = struct.Struct("<I").pack


def _int_head(length: int) -> bytes:
    """The type and length header ``_encode_key`` writes before an int key of ``length`` bytes."""
    return b"i" + _pack_u32(length)


_INT_HEADS = tuple(_int_head(length) for length in range(9))  # looked up for up to 8 bytes


def _encode_key(key: object) -> bytes:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(
            f"derive_seed keys must be int or str, got {type(key).__name__} {key!r}; "
            "convert it first, e.g. str(key) or int(key)."
        )
    if isinstance(key, int):
        length = (key.bit_length() + 8) // 8  # room for the sign bit
        body = key.to_bytes(length, "little", signed=True)
        return _int_head(length) + body
    data = key.encode("utf-8", "surrogatepass")
    return b"s" + _pack_u32(len(data)) + data


def _start(seed: int, n_keys: int) -> Any:
    """The derivation's hash after the seed and the key count (the keys follow, encoded)."""
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update(seed.to_bytes(8, "little"))
    h.update(_pack_u32(n_keys))
    return h


def derive_seed(seed: int, *keys: int | str) -> int:
    """Derive a 64-bit child seed from ``seed`` and ``keys``: pure, stable across processes.

    Distinct key tuples give distinct seeds (``1`` and ``"1"`` differ, so do ``("a", 1)`` and
    ``("a1",)``), and so do their low 32 bits.

    >>> derive_seed(0, "worker", 3) == derive_seed(0, "worker", 3)
    True
    >>> derive_seed(0, 1) != derive_seed(0, "1")
    True
    >>> 0 <= derive_seed(2**64 - 1, "numpy") < 2**64
    True
    """
    seed = validate_seed(seed)
    h = _start(seed, len(keys))
    for key in keys:
        h.update(_encode_key(key))
    return int.from_bytes(h.digest(), "little")


class Deriver:
    """``derive_seed(seed, *prefix, *rest)`` for a fixed prefix, at the cost of one hash copy.

    Produces exactly ``derive_seed``'s value (a test checks it): the hash state after the seed,
    the key count and the prefix keys is computed once and copied for every call. ``n_keys`` is
    the full key count, prefix included; ``seed`` is not validated (the caller did).
    """

    __slots__ = ("_hash",)

    def __init__(self, seed: int, prefix: tuple[int | str, ...], n_keys: int) -> None:
        h = _start(seed, n_keys)
        for key in prefix:
            h.update(_encode_key(key))
        self._hash = h

    def __call__(self, *rest: int | str) -> int:
        h = self._hash.copy()
        for key in rest:
            h.update(_encode_key(key))
        return int.from_bytes(h.digest(), "little")

    def one(self, key: int) -> int:
        """``self(key)`` for one int key (through ``many``)."""
        return self.many((key,))[0]

    def many(self, keys: Iterable[int]) -> list[int]:
        """``[self(key) for key in keys]`` for int keys (the per-sample hot path: one call per
        batch, ``_encode_key``'s header looked up for lengths up to 8 bytes)."""
        base, heads, from_bytes = self._hash, _INT_HEADS, int.from_bytes
        seeds: list[int] = []
        append = seeds.append
        for key in keys:
            h = base.copy()
            length = (key.bit_length() + 8) >> 3  # room for the sign bit
            head = heads[length] if length < len(heads) else _int_head(length)
            h.update(head + key.to_bytes(length, "little", signed=True))
            append(from_bytes(h.digest(), "little"))
        return seeds


def _numpy_seed(seed: int) -> int | list[int]:
    """NumPy's legacy seeding takes a 32-bit int (as ``np.random.seed(seed)`` in a user's script)
    or an array of 32-bit words: a larger seed is given as its two words."""
    return seed if seed < 2**32 else [seed & 0xFFFFFFFF, seed >> 32]


def seed_everything(seed: int | None = None) -> int:
    """Seed Python ``random``, NumPy's global RNG (if installed), torch CPU and every device.

    Each global stream is seeded with the seed itself, as ``random.seed(seed)``,
    ``np.random.seed(seed)`` and ``torch.manual_seed(seed)`` would (and Lightning's and
    transformers' own seeding): a project that adopts torchrepro keeps the results it had.
    Workers, ranks and samples get seeds derived from it (``derive_seed``). ``None`` draws a
    fresh seed from OS entropy. Returns the seed used, so it can be logged. RNG *objects* you created
    (``torch.Generator``, ``numpy.random.Generator``) are not reached by global seeding: create
    them from ``derive_seed(seed, "name")``.

    >>> seed_everything(7)
    7
    """
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    seed = validate_seed(seed)
    global _current_seed
    seed_streams(seed, idle_cuda=True)
    _current_seed = seed
    return seed


def seed_streams(seed: int, *, idle_cuda: bool) -> None:
    """Seed Python ``random``, NumPy's global RNG and torch with ``seed`` itself.

    ``idle_cuda=True`` seeds every device like ``torch.manual_seed`` (queueing the seed for a CUDA
    not started yet); ``False`` seeds CUDA only when it has started (``fork_rng``: a block must
    not leave a seed queued for a CUDA it never used).
    """
    random.seed(seed)
    np = numpy_or_none()
    if np is not None:
        np.random.seed(_numpy_seed(seed))
    if idle_cuda:
        # torch.manual_seed seeds the CPU generator and every initialised or lazy device generator.
        torch.manual_seed(seed)
        return
    torch.default_generator.manual_seed(seed)
    if cuda_started():
        torch.cuda.manual_seed_all(seed)


def current_seed() -> int | None:
    """The seed last given to ``seed_everything`` in this process, or ``None``."""
    return _current_seed


PYTHON_RNG, NUMPY_RNG, TORCH_RNG = 1, 2, 4
"""Bits naming the global RNGs ``sample_seeder`` seeds (Python ``random``, NumPy, torch CPU)."""
ALL_RNGS = PYTHON_RNG | NUMPY_RNG | TORCH_RNG


def sample_seeder(np: Any, which: int = ALL_RNGS) -> Callable[[int], None]:
    """A function seeding Python, NumPy's global RNG and torch's CPU RNG (those named in the bit
    mask ``which``) from one 64-bit seed.

    The per-sample seeder of ``SeededLoader`` (``np``: the NumPy module or None), resolved once
    per batch, called per sample. The cheapest call per library:
    ``torch.default_generator.manual_seed`` (not ``torch.manual_seed``, which visits every
    device) and NumPy's one-word seeding. torch's Mersenne Twister takes the low 32 bits, so
    NumPy gets the high 32 bits (the same word would give both the same stream); Python's
    ``random`` takes all 64 bits. ``random.seed(int)`` is type checks, then the C seeding and
    ``gauss_next = None``: for the stock module-level generator the checks are skipped (the same
    state, ~1 us less per sample); a patched ``random.seed`` is called as it is.
    """
    torch_seed = torch.default_generator.manual_seed if which & TORCH_RNG else _seed_nothing
    np_seed = np.random.seed if np is not None and which & NUMPY_RNG else _seed_nothing
    if not which & PYTHON_RNG:

        def seed_some(s: int) -> None:
            np_seed(s >> 32)
            torch_seed(s)

        return seed_some
    inst: Any = getattr(random, "_inst", None)
    if type(inst) is random.Random and getattr(random.seed, "__self__", None) is inst:
        generator: Any = inst
        c_seed = _CRandom.seed.__get__(generator)

        def seed(s: int) -> None:
            c_seed(s)
            generator.gauss_next = None
            np_seed(s >> 32)
            torch_seed(s)

        return seed
    py_seed = random.seed

    def seed_public(s: int) -> None:
        py_seed(s)
        np_seed(s >> 32)
        torch_seed(s)

    return seed_public


def _seed_nothing(word: int) -> None:
    """Seeds nothing (an RNG left out of the mask, or NumPy not installed)."""
