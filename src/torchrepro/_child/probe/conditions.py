"""The calls whose arguments decide an op-table condition (``audit.optable``), by line.

Invariants:
- ``ConditionWatcher`` wraps the few functions (and their tensor methods) whose arguments decide
  whether an op is deterministic: ``cumsum`` (a floating dtype), ``bincount`` (weights),
  ``scatter``/``scatter_reduce`` (the reduction), ``nll_loss``/``cross_entropy`` (the
  reduction), ``embedding_bag`` (the mode). It notes the facts of each call, once per distinct
  (function, line, facts) and at most 10,000, then calls the original with the same arguments.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchrepro._child.probe.watcher import user_location

__all__ = ["ConditionWatcher"]

_Facts = Callable[[Sequence[Any], Mapping[str, Any]], dict[str, Any]]


def _pos(a: Sequence[Any], kw: Mapping[str, Any], index: int, key: str, default: Any) -> Any:
    return kw[key] if key in kw else (a[index] if len(a) > index else default)


def _cumsum(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
    dtype = kw.get("dtype") or getattr(a[0], "dtype", None)
    return {"floating": dtype.is_floating_point or dtype.is_complex} if dtype is not None else {}


def _bincount(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
    return {"weights": _pos(a, kw, 1, "weights", None) is not None}


def _scatter_reduce(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
    return {"reduce": _pos(a, kw, 4, "reduce", None)}


def _scatter(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
    return {"reduce": kw["reduce"]} if "reduce" in kw else {}  # keyword-only in torch


def _loss(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
    reduction = _pos(a, kw, 6, "reduction", "mean")
    return {"reduction": "none" if kw.get("reduce") is False else reduction}


def _embedding_bag(a: Sequence[Any], kw: Mapping[str, Any]) -> dict[str, Any]:
    return {"mode": _pos(a, kw, 6, "mode", "mean")}


class ConditionWatcher:
    """Records the calls that decide an op-table condition (``calls``)."""

    def __init__(self) -> None:
        self.calls: dict[tuple[Any, ...], dict[str, Any]] = {}

    def install(self) -> None:
        import torch.nn.functional as fn

        for owner in (torch, torch.Tensor):
            self._wrap(owner, "cumsum", _cumsum)
            self._wrap(owner, "bincount", _bincount)
            self._wrap(owner, "scatter_reduce", _scatter_reduce)
            self._wrap(owner, "scatter", _scatter)
        self._wrap(torch.Tensor, "scatter_", _scatter)
        self._wrap(torch.Tensor, "cumsum_", _cumsum)
        self._wrap(torch.Tensor, "scatter_reduce_", _scatter_reduce)
        self._wrap(fn, "nll_loss", _loss)
        self._wrap(fn, "cross_entropy", _loss)
        self._wrap(fn, "embedding_bag", _embedding_bag)

    def after_fork(self) -> None:
        self.calls = {}

    def collect(self) -> dict[str, Any]:
        return {"calls": tuple(self.calls.values())}

    def _wrap(self, owner: Any, name: str, facts: _Facts) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        watcher = self

        @functools.wraps(original)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with contextlib.suppress(Exception):
                if len(watcher.calls) < 10_000:
                    record = {"fn": name.rstrip("_"), "location": user_location(), **facts(a, kw)}
                    watcher.calls.setdefault(tuple(sorted(record.items())), record)
            return original(*a, **kw)

        setattr(owner, name, wrapper)
