"""Which global RNGs a dataset draws from, and the RNG objects it holds.

Invariants:
- ``Watch`` is one process's view of which of Python's ``random`` and NumPy's global RNG a
  dataset draws from (torch's CPU RNG is always seeded per sample: it costs 2 us, and a dataset
  may read ``torch.initial_seed()`` without drawing, which no check after a batch could see). What
  a process learned only decides how much seeding work it does, never a sample's value.
- ``rng_tokens`` changes whenever one of the named global RNGs is seeded or drawn from (through
  ``rawrng``'s tokens, a fraction of a full save); ``_changed`` names the ones that moved.
- RNG objects a dataset holds (``random.Random`` but not ``SystemRandom``, ``torch.Generator``,
  ``numpy.random.Generator``/``RandomState``: copied into every worker, where each would repeat
  the same draws) are found once by attribute path (names and list positions, at most 4 deep and
  64 items per level) and reseeded before every sample from ``derive_seed(seed, "object", epoch,
  index, path)``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from torchrepro._compat import numpy_or_none
from torchrepro.data.rawrng import _python_mt, numpy_mt
from torchrepro.seeding import NUMPY_RNG, PYTHON_RNG, TORCH_RNG, Deriver

# --------------------------------------------------------------------------------------------
# The global RNGs.


class Watch:
    """Which global RNGs (``seeding.*_RNG`` bits) a dataset draws from, as one process saw it."""

    __slots__ = ("available", "drawn", "seeded")

    def __init__(self) -> None:
        # torch's RNG is always seeded per sample (2 us): datasets read torch.initial_seed()
        # without drawing (to seed something else), which no check after the batch could see.
        self.available = PYTHON_RNG | NUMPY_RNG if numpy_or_none() is not None else PYTHON_RNG
        self.seeded = self.available  # seeded per sample
        self.drawn = 0  # seen drawn from: seeded per sample for good

    def __getstate__(self) -> tuple[int, int, int]:
        return self.available, self.drawn, self.seeded

    def __setstate__(self, state: tuple[int, int, int]) -> None:
        self.available, self.drawn, self.seeded = state


def rng_tokens(which: int, np: Any) -> tuple[Any, Any, Any]:
    """Something that changes whenever the global RNGs in ``which`` are drawn from."""
    return (
        _python_mt.token() if which & PYTHON_RNG else None,
        numpy_mt.token(np) if which & NUMPY_RNG else None,
        torch.default_generator.get_state() if which & TORCH_RNG else None,
    )


def _changed(which: int, before: tuple[Any, Any, Any], np: Any) -> int:
    """The RNGs in ``which`` whose state differs from the tokens ``before``."""
    now = rng_tokens(which, np)
    changed = 0
    if which & PYTHON_RNG and now[0] != before[0]:
        changed |= PYTHON_RNG
    if which & NUMPY_RNG and now[1] != before[1]:
        changed |= NUMPY_RNG
    if which & TORCH_RNG and not torch.equal(now[2], before[2]):
        changed |= TORCH_RNG
    return changed


# --------------------------------------------------------------------------------------------
# RNG objects a dataset holds (copied into every worker): re-keyed per sample like the globals.


def _rng_types() -> tuple[type, ...]:
    types: list[type] = [random.Random, torch.Generator]
    np = numpy_or_none()
    if np is not None:
        types += [np.random.Generator, np.random.RandomState]
    return tuple(types)


Path = tuple[str | int, ...]


def find_rng_objects(dataset: object, *, max_depth: int = 4, max_items: int = 64) -> tuple[Path, ...]:
    """Attribute paths (names, list positions) from ``dataset`` to the RNG objects it holds."""
    rng_types = _rng_types()
    found: list[Path] = []
    seen: set[int] = set()
    skip = (str, bytes, int, float, bool, torch.Tensor, torch.nn.Module, type)

    def visit(obj: object, path: Path) -> None:
        if id(obj) in seen or isinstance(obj, skip) or len(path) > max_depth:
            return
        seen.add(id(obj))
        if isinstance(obj, rng_types):
            if not isinstance(obj, random.SystemRandom):
                found.append(path)
            return
        if isinstance(obj, (list, tuple)):
            for pos, item in enumerate(obj[:max_items]):
                visit(item, (*path, pos))
            return
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict) and type(obj).__module__ not in ("numpy", "builtins"):
            for name, value in list(attrs.items())[:max_items]:
                visit(value, (*path, name))

    visit(dataset, ())
    return tuple(path for path in found if path)


def _resolve(root: object, path: Path) -> object:
    obj = root
    for step in path:
        obj = obj[step] if isinstance(step, int) else getattr(obj, step)  # type: ignore[index]
    return obj


def _reseed_object(obj: object, s: int, np: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.manual_seed(s)
    elif isinstance(obj, random.Random):
        obj.seed(s)
    elif np is not None and isinstance(obj, np.random.RandomState):
        obj.seed(s >> 32)
    elif np is not None and isinstance(obj, np.random.Generator):
        bit_generator = obj.bit_generator
        bit_generator.state = type(bit_generator)(s).state


def reseed_objects(
    dataset: object, paths: tuple[Path, ...], index: int, object_seed: Deriver, np: Any
) -> None:
    """Reseed the RNG objects ``dataset`` holds at ``paths`` for sample ``index`` (``object_seed``:
    the epoch's ``derive_seed(seed, "object", epoch, ...)``)."""
    for path in paths:
        _reseed_object(_resolve(dataset, path), object_seed(index, _path_key(path)), np)


def _path_key(path: Path) -> str:
    return ".".join(str(step) for step in path)
