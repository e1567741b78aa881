"""What the audit's probe saw of a script's settings: written by the child, judged by the rules.

Invariants:
- ``ProbeSettings`` is the one shape of that record: ``_child.probe`` builds it, writes
  ``to_dict()`` as JSON, ``audit.runner`` reads it back with ``from_dict()``, and the settings
  rules take it. This module imports nothing of torchrepro but ``errors`` (standard library only),
  so both sides import it without a cycle.
- A field for a determinism switch has exactly the name of ``DeterminismFlags``'s field for it
  (``cuda_matmul_allow_tf32``, ``cublas_workspace_config``, ...); a test keeps them equal.
- ``from_dict`` checks every field: a missing, unknown or mistyped field raises ``TraceError``
  naming it, the expected type and the value found; never a ``KeyError`` from a rule.
- ``to_dict`` gives the fields in declaration order (the ``settings`` object of ``audit --json``).
"""

from __future__ import annotations

import dataclasses
import json  # noqa: F401 (the doctest)
from collections.abc import Callable, Mapping
from typing import Any

from torchrepro.errors import TraceError

__all__ = ["ProbeSettings"]


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _mapping_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, Mapping) and all(isinstance(k, str) and check(x) for k, x in v.items())


def _records(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_mapping_of(lambda _: True)(r) for r in v)


# annotation (as written below) -> (check of a JSON value, what the error calls it)
_CHECKS: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "bool": (_is_bool, "true or false"),
    "bool | None": (_optional(_is_bool), "true, false or null"),
    "int": (_is_int, "an integer"),
    "str | None": (_optional(lambda v: isinstance(v, str)), "a string or null"),
    "Mapping[str, bool]": (_mapping_of(_is_bool), "an object of true/false values"),
    "Mapping[str, str | None]": (
        _mapping_of(_optional(lambda v: isinstance(v, str))),
        "an object of string or null values",
    ),
    "tuple[Mapping[str, Any], ...]": (_records, "an array of objects"),
}


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """The settings an audited script ran with, and what it seeded, compiled and loaded.

    The switches are those of :class:`torchrepro.DeterminismFlags` under the same names, read
    after each optimizer step (``warn_only``: what the script asked for; the probe runs it
    warn-only). The records (``dataloaders``, ``compile_calls``, ``tainted_seeds``, ``calls``) are
    JSON objects whose keys the rules read with defaults.

    >>> from torchrepro._child.probe import SettingsProbe
    >>> s = SettingsProbe("unused.json").snapshot()  # what a probe saw so far (not installed)
    >>> ProbeSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    True
    """

    hash_randomization: bool
    pythonhashseed: str | None
    cublas_workspace_config: str | None
    deterministic_algorithms: bool
    warn_only: bool
    cudnn_benchmark: bool
    cudnn_deterministic: bool
    cudnn_allow_tf32: bool | None
    cuda_matmul_allow_tf32: bool | None
    float32_matmul_precision: str | None
    num_threads: int
    set_num_threads_called: bool
    thread_env: Mapping[str, str | None]
    torch_seeded: bool
    seeded: Mapping[str, bool]
    tainted_seeds: tuple[Mapping[str, Any], ...]
    inductor_deterministic: bool | None
    compile_calls: tuple[Mapping[str, Any], ...]
    dataloaders: tuple[Mapping[str, Any], ...]
    optimizer_steps: int
    calls: tuple[Mapping[str, Any], ...]
    cuda_initialized: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field, in declaration order (records as arrays of objects)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = [dict(r) for r in value]
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: Any) -> ProbeSettings:
        """Inverse of :meth:`to_dict`; raises ``TraceError`` naming a missing, unknown or bad field."""
        if not isinstance(d, Mapping):
            raise TraceError(f"The probe's settings must be a JSON object, got {type(d).__name__}.")
        fields = dataclasses.fields(cls)
        names = [f.name for f in fields]
        missing = [n for n in names if n not in d]
        unknown = sorted(str(k) for k in d if k not in names)
        if missing or unknown:
            raise TraceError(
                "The probe's settings do not have the expected fields"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
                + " (written by another torchrepro version?)."
            )
        values: dict[str, Any] = {}
        for f in fields:
            check, expected = _CHECKS[str(f.type)]
            value = d[f.name]
            if not check(value):
                raise TraceError(f"The probe's setting {f.name!r} must be {expected}, got {value!r}.")
            values[f.name] = tuple(dict(r) for r in value) if isinstance(value, (list, tuple)) else value
        return cls(**values)
