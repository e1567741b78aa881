"""How far two recorded tensors are apart: the first differing tensor of a diverging event.

Invariants: equal values (equal infinities, NaN in both runs) are no difference; NaN or an
infinity against another value is an unbounded difference (``nonfinite``, ``max_abs_diff``
None), so every result is strict JSON; a large tensor's difference is taken from the evenly
spaced sample the recorder keeps, a lower bound (``sampled``).
"""

from __future__ import annotations

import math
from typing import Any

from torchrepro.results import (
    TensorDifference,
)

__all__ = ["largest_difference", "leaf_difference", "recorded_numbers", "tensor_difference"]


def largest_difference(va: list[float], vb: list[float]) -> float | None:
    """The largest ``|a-b|`` over elements that differ (0.0: none); None when it is unbounded."""
    largest = 0.0
    for x, y in zip(va, vb, strict=True):
        x, y = float(x), float(y)
        if x == y or (math.isnan(x) and math.isnan(y)):  # equal, equal infinities, NaN in both
            continue
        d = abs(x - y)
        if not math.isfinite(d):  # NaN or an infinity against another value, or an overflow
            return None
        largest = max(largest, d)
    return largest


def tensor_difference(a: dict[str, Any], b: dict[str, Any]) -> TensorDifference | None:
    """The first differing tensor leaf of two events, with its largest absolute difference if stored
    (every value of a small tensor; the recorder's sample of a large one, a lower bound)."""
    for i, (la, lb) in enumerate(zip(a.get("t", []), b.get("t", []), strict=False)):
        if la["fp"] == lb["fp"]:
            continue
        diff, nonfinite, sampled = leaf_difference(la, lb)
        return TensorDifference(
            leaf=i,
            shape=list(la["shape"]),
            dtype=str(la["dtype"]),
            max_abs_diff=diff,
            nonfinite=nonfinite,
            name=la.get("n"),
            sampled=sampled,
        )
    return None


def leaf_difference(la: dict[str, Any], lb: dict[str, Any]) -> tuple[float | None, bool, bool]:
    """``(largest |a-b|, nonfinite, sampled)`` of two recorded tensor leaves from their stored values:
    all of them (``v``), else the recorder's sample (``s``, ``sampled``: a lower bound); the
    difference is None when neither run stored comparable values, or when it is unbounded
    (``nonfinite``)."""
    for key in ("v", "s"):
        va, vb = recorded_numbers(la.get(key)), recorded_numbers(lb.get(key))
        if va is not None and vb is not None and len(va) == len(vb) and la.get("shape") == lb.get("shape"):
            diff = largest_difference(va, vb)
            return diff, diff is None, key == "s"
    return None, False, False


def recorded_numbers(values: Any) -> list[float] | None:
    """Recorded values (``v``, ``s``) as floats, or None when they are not a list of numbers."""
    if isinstance(values, list) and all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in values
    ):
        return [float(x) for x in values]
    return None
