"""Seeding: the script's seeding calls, the unseeded sources a seed may come from, tainted seeds.

Invariants:
- ``SeedWatcher`` wraps the seeding functions (``random.seed``, ``np.random.seed``,
  ``torch.manual_seed``, ``torch.seed``, ``np.random.default_rng``, and ``torch.Generator``,
  replaced by a subclass: see ``watch_generators``) and the unseeded sources a seed may be drawn
  from (``random.randint``/``randrange``/``getrandbits``/``random``, ``np.random.randint``,
  ``secrets.randbits``/``randbelow``, ``os.urandom``, ``time.time``/``time_ns``,
  ``os.getpid``): they only note values and call through to the original unchanged.
- A seed is tainted when it came from such a source (``on_seed``: by identity, by value, the
  clock, OS entropy, or the script's own source read by ``_child.sources``); a global RNG
  counts as seeded when its last seeding was untainted. The probe's own calls and a dataset
  seeding itself while a DataLoader (or ``datasets.probe_dataset``) loads never count.
- What a fork inherits, its seeding, stays; the tainted seeds it reports are its own.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any

import torch

from torchrepro._child.probe.datasets import probe_dataset
from torchrepro._child.probe.watcher import GLOBAL_RNGS, PACKAGE_DIR, code_of, optional_numpy
from torchrepro._child.sources import seed_source
from torchrepro._frames import is_user, user_site

__all__ = ["SeedWatcher"]


def _in_loader_fetch() -> bool:
    """Whether a DataLoader (or the probe) is loading samples up the stack: a dataset seeding
    itself per index is not the script seeding."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is probe_dataset.__code__ or frame.f_code.co_filename.endswith(
            os.path.join("_utils", "fetch.py")
        ):
            return True
        frame = frame.f_back
    return False


class SeedWatcher:
    """Records the script's seeding (``torch_seeded``, ``seeded``, ``tainted_seeds``)."""

    def __init__(self) -> None:
        self.start_seed = torch.initial_seed()
        # the script's seeding: per global RNG, whether its last seeding used a value no other
        # unseeded source produced; and each seeding call whose value came from one
        self.seeded: dict[str, bool] = {}
        self.tainted_seeds: list[dict[str, Any]] = []
        self._drawn: dict[int, str] = {}  # values unseeded sources returned -> the source
        self._drawn_objects: dict[int, tuple[Any, str]] = {}  # id -> (int object returned, source)
        self._sites: dict[tuple[str, int], str] = {}  # (file, line) an unseeded source was called from
        self._wrapper_codes: set[Any] = set()

    def install(self) -> None:
        """Wrap the seeding functions, and the unseeded sources a seed may be drawn from.

        Seeding: ``random.seed``, ``np.random.seed``, ``torch.manual_seed`` (the global RNGs),
        ``torch.Generator(...).manual_seed``/``.seed`` (``torch.Generator`` becomes a subclass
        whose instances pass every ``isinstance`` check and pickle as plain generators) and
        ``np.random.default_rng``. Sources: ``random.randint``/``randrange``/``getrandbits``/
        ``random`` before any ``random.seed``, ``np.random.randint`` likewise, ``secrets``,
        ``os.urandom``, ``torch.seed()``, the clock (``time.time``/``time_ns``) and the process
        id (``os.getpid``). A seed is tainted (TR305) when its value is an object such a source
        returned (by identity: never a small cached int), a value of 2**16 and up one returned
        (so a small constant is never mistaken for one), the clock (within an hour of now, in
        s, ms, us or ns), ``seed()`` from OS entropy, or, read from the script's own source
        (``_child.sources``), an expression that called such a source on a line where the probe
        saw it called unseeded. A global seeding call counts as seeding its RNG when untainted;
        calls made while a DataLoader fetches (a dataset seeding itself per index) do not count.
        """
        import random
        import secrets
        import time

        watcher = self
        numpy = optional_numpy()

        def unseeded_source(
            owner: Any,
            name: str,
            source: str,
            rng: str | None,
            to_int: Any = None,
            *,
            user_only: bool = False,
        ) -> None:
            original = getattr(owner, name, None)
            if original is None:
                return

            @functools.wraps(original)
            def wrapper(*a: Any, **kw: Any) -> Any:
                value = original(*a, **kw)
                if rng is None or not watcher.seeded.get(rng):
                    with contextlib.suppress(Exception):
                        watcher.drawn_from(source, value, sys._getframe(1), to_int, user_only=user_only)
                return value

            wrapper._torchrepro_source = source  # type: ignore[attr-defined]
            watcher._wrapper_codes.add(code_of(wrapper))
            setattr(owner, name, wrapper)

        def ints(value: Any) -> list[int]:
            return [int(value)]

        def from_bytes(value: Any) -> list[int]:
            return [int.from_bytes(value, "big"), int.from_bytes(value, "little")] if len(value) <= 8 else []

        def seeding(owner: Any, name: str, rng: str, what: str) -> None:
            original = getattr(owner, name)

            @functools.wraps(original)
            def wrapper(*a: Any, **kw: Any) -> Any:
                value = a[0] if a else next(iter(kw.values()), None)
                with contextlib.suppress(Exception):
                    if not _in_loader_fetch():
                        watcher.on_seed(rng, what, value, sys._getframe(1))
                return original(*a, **kw)

            setattr(owner, name, wrapper)

        for name in ("randint", "randrange", "getrandbits"):
            unseeded_source(random, name, f"random.{name}", "random", ints)
        unseeded_source(random, "random", "random.random", "random")
        for name in ("randbits", "randbelow"):
            unseeded_source(secrets, name, f"secrets.{name}", None, ints)
        unseeded_source(os, "urandom", "os.urandom", None, from_bytes)
        unseeded_source(torch, "seed", "torch.seed()", None, ints)
        # called by libraries all the time: noted only where the script calls them
        unseeded_source(time, "time", "time.time", None, user_only=True)
        unseeded_source(time, "time_ns", "time.time_ns", None, user_only=True)
        unseeded_source(os, "getpid", "os.getpid", None, user_only=True)
        entropy_seed = torch.seed

        @functools.wraps(entropy_seed)
        def torch_seed() -> int:
            watcher.seeded["torch"] = False  # torch.seed() seeds from OS entropy
            return entropy_seed()

        torch.seed = torch_seed
        self._wrapper_codes.add(code_of(torch_seed))
        seeding(random, "seed", "random", "random.seed")
        seeding(torch, "manual_seed", "torch", "torch.manual_seed")
        self.watch_generators()
        if numpy is not None:
            unseeded_source(
                numpy.random, "randint", "np.random.randint", "numpy", lambda v: numpy.ravel(v)[:1]
            )
            seeding(numpy.random, "seed", "numpy", "np.random.seed")
            default_rng = numpy.random.default_rng

            @functools.wraps(default_rng)
            def default_rng_(*a: Any, **kw: Any) -> Any:
                value = a[0] if a else kw.get("seed")
                with contextlib.suppress(Exception):
                    frame = sys._getframe(1)
                    if value is not None and is_user(frame):  # None: OS entropy, TR306's
                        watcher.on_seed("numpy_generator", "np.random.default_rng", value, frame)
                return default_rng(*a, **kw)

            numpy.random.default_rng = default_rng_

    def after_fork(self) -> None:
        self.tainted_seeds = []

    def collect(self) -> dict[str, Any]:
        torch_seeded = torch.initial_seed() != self.start_seed
        return {
            "torch_seeded": torch_seeded,
            "seeded": {
                "random": self.seeded.get("random", False),
                "numpy": self.seeded.get("numpy", False),
                "torch": torch_seeded and self.seeded.get("torch", True),
            },
            "tainted_seeds": tuple(self.tainted_seeds),
        }

    def watch_generators(self) -> None:
        """Make ``torch.Generator(...)`` a subclass instance whose seeding the probe notes.

        ``torch._C.Generator`` is a C type (its methods cannot be replaced), so ``torch.Generator``
        becomes a subclass: ``isinstance(x, torch.Generator)`` still holds for every generator
        (torch's own default ones included), every op and ``DataLoader(generator=...)`` takes it,
        and it pickles (``torch.save``) as a plain ``torch.Generator``. Only seeding called
        from the script's own code is noted (not torch's samplers seeding theirs).
        """
        base: Any = torch.Generator
        watcher = self

        class _Meta(type(base)):  # type: ignore[misc]
            def __instancecheck__(cls, obj: Any) -> bool:
                return isinstance(obj, base)

            def __subclasscheck__(cls, sub: Any) -> bool:
                return issubclass(sub, base)

        def note(value: Any, what: str) -> None:
            with contextlib.suppress(Exception):
                frame = sys._getframe(2)
                if is_user(frame):
                    watcher.on_seed("generator", what, value, frame)

        class Generator(base, metaclass=_Meta):  # type: ignore[misc]
            __doc__ = base.__doc__

            def manual_seed(self, seed: Any) -> Any:
                note(seed, "torch.Generator().manual_seed")
                return super().manual_seed(seed)

            def seed(self) -> Any:
                note(None, "torch.Generator().seed")
                return super().seed()

            def __reduce__(self) -> Any:
                reduced = super().__reduce__()
                return (base, *reduced[1:])

        Generator.__module__ = base.__module__
        Generator.__qualname__ = Generator.__name__ = "Generator"
        torch.Generator = Generator  # type: ignore[misc]

    def drawn_from(self, source: str, value: Any, frame: Any, to_int: Any, *, user_only: bool) -> None:
        """An unseeded source returned ``value`` to ``frame``'s line: note the line (for the
        source tracing of ``_child.sources``), the object (by identity), and large values."""
        import numbers

        while frame is not None and frame.f_code in self._wrapper_codes:
            frame = frame.f_back  # a wrapper of ours calling another
        if (
            frame is None
            or os.path.dirname(frame.f_code.co_filename) == PACKAGE_DIR
            or (user_only and not is_user(frame))
        ):
            return  # the probe's own call, or (the clock, the pid) a library's
        if len(self._sites) < 10_000:
            self._sites.setdefault((frame.f_code.co_filename, frame.f_lineno), source)
        small = isinstance(value, int) and -5 <= value <= 256  # cached: one object for every 42
        if isinstance(value, numbers.Integral) and not small and len(self._drawn_objects) < 10_000:
            self._drawn_objects.setdefault(id(value), (value, source))
        if to_int is not None and len(self._drawn) < 10_000:
            for v in to_int(value):
                if abs(v) >= 2**16:  # a small constant seed (0, 42) is never taken for one
                    self._drawn.setdefault(v, source)

    def _confirmed(self, filename: str, first: int, last: int, source: str) -> bool:
        return any(self._sites.get((filename, line)) == source for line in range(first, last + 1))

    def on_seed(self, rng: str, what: str, value: Any, frame: Any = None) -> None:
        """A seeding call (``rng``: ``random``, ``numpy``, ``torch`` for the global RNGs, else a
        generator's kind) with ``value``, made from ``frame``'s line."""
        import operator
        import time

        if value is None:
            source: str | None = "OS entropy (called without a seed)"
        else:
            try:
                number = operator.index(value)
            except TypeError:
                number = None
            drawn = self._drawn_objects.get(id(value))
            source = drawn[1] if drawn is not None and drawn[0] is value else None
            if source is None and number is not None:
                source = self._drawn.get(number)
            if number is not None and source is None and number > 10**9:
                # the clock in seconds, milliseconds or nanoseconds, within an hour of now
                now = time.time()
                if any(abs(number / scale - now) < 3600 for scale in (1, 10**3, 10**6, 10**9)):
                    source = "the current time"
            if source is None and frame is not None and is_user(frame):  # the script's own call
                with contextlib.suppress(Exception):
                    source = seed_source(frame, self._confirmed)
        if rng in GLOBAL_RNGS:
            self.seeded[rng] = source is None
        if source is not None and len(self.tainted_seeds) < 100:
            location, framework = user_site()
            record = {
                "call": what,
                "rng": rng,
                "location": location,
                "source": source,
                "framework": framework,
            }
            if record not in self.tainted_seeds:
                self.tainted_seeds.append(record)
