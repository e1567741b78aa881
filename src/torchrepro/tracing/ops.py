"""Plain data of op tracing: ``OpEvent``, ``OpDivergence`` and the trace file's format constants.

Invariants:
- Imports no torch: reading recorded events and comparing trace files never loads torch's dispatch
  internals.
- Both classes are frozen dataclasses; ``OpEvent.from_dict`` reads back what ``to_dict`` writes and
  raises ``TraceError`` naming a bad field.
- ``FORMAT`` and ``FORMAT_VERSION`` are the trace file's identity; the writer (``tracer``) and the
  reader (``compare``) take them from here only. The header also names the digest algorithm
  (``digest``); a trace without it was hashed with ``LEGACY_DIGEST``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from torchrepro.errors import TraceError

FORMAT: Final = "torchrepro.trace"
FORMAT_VERSION: Final = 1
LEGACY_DIGEST: Final = "sha1"
"""The digest algorithm of traces written before the header named one."""

MAX_FACTS: Final = 3
"""The most facts an ``OpEvent`` keeps (the first distinct ones)."""

COLLECTIVE_NAMESPACES: Final = ("c10d.", "_c10d_functional.", "c10d_functional.")


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
    this (op, module, location, backward) combination ran; ``facts`` what the recorder's ``facts``
    function said about its calls (the audit's: why a call's CPU result depends on the thread
    count), distinct, in first-seen order, at most ``MAX_FACTS``.
    """

    op: str
    module: str | None
    location: str | None
    backward: bool
    count: int = 1
    facts: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (``OpEvent.from_dict`` reads it back); ``facts`` only when there are some."""
        d = dataclasses.asdict(self)
        d["facts"] = list(self.facts)
        if not self.facts:
            del d["facts"]
        return d

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
        facts = d.get("facts", [])
        if not isinstance(facts, list) or not all(isinstance(f, str) for f in facts):
            raise TraceError(f"An op event needs 'facts' as a list of strings when given; got {d!r}.")
        return cls(
            op=op, module=module, location=location, backward=backward, count=count, facts=tuple(facts)
        )


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
