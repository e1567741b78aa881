"""The run record's event vocabulary: kinds, keys, tensor names, and the order of divergences.

A recorded run is a list of events per rank (``runrecord`` stores them, ``recorder`` writes them,
``compare`` and ``check`` read them); this module is the one place that says what they mean.

Invariants:
- ``EVENT_KINDS`` are every kind an events file may hold, in the order a rank meets them within
  one step: the parameters an optimizer is given (``init``, step 0), the batch (``data``, its index
  is the step), values the script records during the step (``record``), then the optimizer step
  (``compute``). The ``compute`` event keyed ``FINAL_KEY`` (the state at exit) comes after every
  step and is never a training step.
- Keys: ``optimizer<N>`` (the N-th optimizer the script created), ``loader<N>``, ``BACKWARD_KEY``
  (steps no optimizer sees, one per ``backward()``), ``FINAL_KEY``, or a name given to ``record``.
- Tensor names of ``init``/``compute`` events: ``param:<path>``, ``grad:<path>``,
  ``state:<path>:<key>``, ``final:<path>`` (see ``_child.training``).
- Across world sizes (``check --vary world``, ``compare`` of records from different numbers of
  processes) only ``world_invariant`` events are compared: what an optimizer is given (``init``),
  its steps (``compute`` of ``optimizer<N>``) and the state at exit; batches, recorded values and
  ``backward()`` steps depend on how a global batch is split across processes.
- One rule orders divergences, for ``check`` (several runs against the first) and ``compare``
  (two runs) alike: the earliest step; at one step the event a rank meets first (its batch and
  recorded values before the optimizer step whose all-reduced gradients spread a difference to
  every rank); then the earlier run; then the lower rank.

Standard library only: every part may import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, Protocol, TypeVar

__all__ = [
    "BACKWARD_KEY",
    "EVENT_KINDS",
    "FINAL_KEY",
    "counted_kind",
    "describe_name",
    "divergence_order",
    "earliest",
    "in_order",
    "is_optimizer_key",
    "is_step",
    "optimizer_index",
    "optimizer_key",
    "world_invariant",
]

EVENT_KINDS: Final = ("init", "data", "record", "compute")
"""The kinds of events an events file may hold, in the order a rank meets them within one step."""

BACKWARD_KEY: Final = "backward"
"""The event key of steps counted by ``backward()`` (training no optimizer sees)."""

FINAL_KEY: Final = "final"
"""The key of the ``compute`` event holding, at exit, the state of the modules ``__main__`` holds."""

_OPTIMIZER: Final = "optimizer"
_ORDER: Final = {kind: i for i, kind in enumerate(EVENT_KINDS)}
_FINAL_ORDER: Final = len(EVENT_KINDS)  # after every kind: the state at exit


def optimizer_key(index: int) -> str:
    """The key of the events of the ``index``-th optimizer a script created (``optimizer0``)."""
    return f"{_OPTIMIZER}{index}"


def optimizer_index(key: str | None) -> int:
    """The optimizer an event key names (``optimizer2`` -> 2; ``backward`` -> -1, steps counted
    by ``backward()``; anything else -> 0): the child's ``trace_optimizer``."""
    if key and key.startswith(_OPTIMIZER) and key[len(_OPTIMIZER) :].isdigit():
        return int(key[len(_OPTIMIZER) :])
    if key == BACKWARD_KEY:
        return -1
    return 0


def is_optimizer_key(key: str | None) -> bool:
    """Whether an event key names an optimizer (``optimizer<N>``), not ``backward``, ``final``,
    a loader or a recorded name."""
    return bool(key and key.startswith(_OPTIMIZER) and key[len(_OPTIMIZER) :].isdigit())


def counted_kind(kind: str, key: str | None) -> str:
    """The kind an event counts as in a coverage: the state at exit is ``final``, not a step."""
    return FINAL_KEY if kind == "compute" and key == FINAL_KEY else kind


def is_step(kind: str, key: str | None, *, backward: bool = False) -> bool:
    """Whether an event is a training step of the first optimizer (``backward``: a step counted by
    ``backward()``; those come in pairs, the gradients then the parameters after the update)."""
    return kind == "compute" and key == (BACKWARD_KEY if backward else optimizer_key(0))


def world_invariant(kind: str, key: str | None) -> bool:
    """Whether an event must hold the same bits whatever the number of processes a fixed global
    batch is split across: the parameters given to an optimizer (or trained at the first
    ``backward()``), an optimizer step, the state at exit. Not a batch (each process loads its part
    of a global batch), a recorded value (it may be a process's own) or a ``backward()`` step (one
    per micro-batch, so their number depends on the split).

    >>> [world_invariant(k, key) for k, key in [("compute", "optimizer0"), ("data", "loader0")]]
    [True, False]
    """
    if kind == "init":
        return True
    return kind == "compute" and (key == FINAL_KEY or is_optimizer_key(key))


def describe_name(name: str, kind: str) -> str:
    """A recorded tensor name in words."""
    part, _, rest = name.partition(":")
    if part == "grad" and rest:
        return f"gradient of {rest}"
    if part == "param" and rest:
        return f"parameter {rest}"
    if part == FINAL_KEY and rest:
        return f"final value of {rest}"
    if part == "state" and rest:
        param, _, key = rest.rpartition(":")
        return f"optimizer state {key!r} of {param}"
    if kind == "data":
        return f"batch field {name}" if name else "the batch"
    return name or "the value"


class _Divergent(Protocol):
    @property
    def step(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def key(self) -> str | None: ...
    @property
    def rank(self) -> int: ...


_D = TypeVar("_D", bound=_Divergent)


def divergence_order(d: _Divergent, run: int = 1) -> tuple[int, int, int, int]:
    """The sort key of a divergence: (step, the kind's place within a step, run, rank).

    ``run`` is the index of the run compared against the first (``check`` compares several);
    two-run comparisons leave it at 1.
    """
    kind_order = (
        _FINAL_ORDER if counted_kind(d.kind, d.key) == FINAL_KEY else _ORDER.get(d.kind, _FINAL_ORDER)
    )
    return d.step, kind_order, run, d.rank


def earliest(divergences: Iterable[_D]) -> _D | None:
    """The divergence reported among several ranks' first divergences (see ``divergence_order``)."""
    return min(divergences, key=divergence_order, default=None)


def in_order(found: Sequence[tuple[int, _D]]) -> list[tuple[int, _D]]:
    """``(run, divergence)`` pairs sorted by ``divergence_order``: the first is the one reported."""
    return sorted(found, key=lambda x: divergence_order(x[1], x[0]))
