"""``OpRecorder``: which aten ops ran, in which module, at which line (for ``audit``).

Invariants:
- No digests: one :class:`OpEvent` per distinct (op, module, location, backward), in first-seen
  order, with a count.
- Ops of profiler markers, of fingerprinting and of forked processes pass through unrecorded;
  recording changes no numerics and no RNG state.
- ``facts`` (optional) is asked about every call after it ran; what it says (a short text, or
  None) is kept with the event, at most ``MAX_FACTS`` distinct texts each. It must only read.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from torchrepro.hashing import fingerprinting
from torchrepro.tracing.dispatch import IGNORED_NAMESPACES, Observer
from torchrepro.tracing.ops import MAX_FACTS, OpEvent

Facts = Callable[[str, tuple[Any, ...], dict[str, Any], Any], "str | None"]
"""``facts(op, args, kwargs, out)``: what to note about one call of ``op`` (None: nothing)."""

# --------------------------------------------------------------------------------------------
# OpRecorder: which ops ran, where (for audit)
# --------------------------------------------------------------------------------------------


class OpRecorder(Observer):
    """Record every aten op of forward and backward with its module, source line and direction.

    ``start()`` begins recording on this thread; ``stop()`` ends it and returns one
    :class:`OpEvent` per distinct (op, module, location, backward), in first-seen order, with a
    count. Also a context manager (``with OpRecorder() as rec: ...; rec.events``).

    >>> import torch
    >>> from torchrepro.tracing import OpRecorder
    >>> lin = torch.nn.Linear(2, 1)
    >>> with OpRecorder() as rec:
    ...     lin(torch.ones(1, 2)).sum().backward()
    >>> sorted({e.op for e in rec.events if e.module == "Linear" and not e.backward})
    ['aten.addmm.default', 'aten.t.default']
    """

    _what = "OpRecorder"

    def __init__(self, *, facts: Facts | None = None) -> None:
        super().__init__()
        self._counts: dict[tuple[str, str | None, str | None, bool], int] = {}
        self._facts = facts
        self._noted: dict[tuple[str, str | None, str | None, bool], list[str]] = {}
        self._events: list[OpEvent] = []

    def start(self) -> None:
        """Start recording (raises ``TraceError`` if already started)."""
        self._counts = {}
        self._noted = {}
        self._start()

    def stop(self) -> list[OpEvent]:
        """Stop recording and return the events (also kept as :attr:`events`)."""
        self._stop()
        self._events = [
            OpEvent(op, m, loc, bw, n, tuple(self._noted.get((op, m, loc, bw), ())))
            for (op, m, loc, bw), n in self._counts.items()
        ]
        return list(self._events)

    @property
    def events(self) -> list[OpEvent]:
        """The events returned by the last ``stop()``."""
        return list(self._events)

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = self._op_name(func)
        if name.startswith(IGNORED_NAMESPACES) or fingerprinting() or self._forked:
            return func(*args, **kwargs)
        sites = self._sites
        with self._lock:
            module, location, backward = sites.attribute(sys._getframe(1))
        out = func(*args, **kwargs)
        key = (name, module, location, backward)
        fact = self._facts(name, args, kwargs, out) if self._facts is not None else None
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            if fact is not None:
                noted = self._noted.setdefault(key, [])
                if fact not in noted and len(noted) < MAX_FACTS:
                    noted.append(fact)
            if not backward or torch.is_grad_enabled():
                sites.remember(out, (module, location))
        return out
