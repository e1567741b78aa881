"""The environment fingerprint's data: ``Environment`` (what a run's bits depend on besides the
script and its seed) and ``EnvDifference`` (one classified difference), and their validation.

Invariants:
- Every field is plain JSON; ``None`` means "could not be collected". ``Environment.to_dict()`` is
  plain JSON; ``Environment.from_dict`` accepts what any version wrote (missing fields are
  ``None``, unknown fields are kept in ``extra``) and refuses, with an ``EnvFileError``, anything
  else: a non-object, a known field of the wrong type, values that are not strict JSON (NaN,
  infinities, nesting deeper than ``_jsonread.MAX_JSON_DEPTH``...). So whatever an environment
  read from a file holds, every value in it is strict JSON of its field's type.
- This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchrepro._jsonread import json_problem
from torchrepro.errors import EnvFileError

__all__ = ["SCHEMA_VERSION", "EnvDifference", "Environment"]

SCHEMA_VERSION = 1


def _json_value(v: Any) -> Any:
    """A deep JSON-able copy (dicts with string keys, lists, str/int/float/bool/None)."""
    if isinstance(v, Mapping):
        return {str(k): _json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


@dataclass(frozen=True)
class Environment:
    """What a run's bits depend on besides the script and its seed (see ``collect_env``).

    Every field is plain JSON; ``None`` means "could not be collected". ``to_dict``/``from_dict``
    round-trip; ``diff_env`` explains the differences between two.
    """

    collected_at: str | None = None
    hostname: str | None = None
    python_version: str | None = None
    python_implementation: str | None = None
    python_executable: str | None = None
    hash_randomization: bool | None = None
    platform: str | None = None
    machine: str | None = None
    libc: str | None = None
    torchrepro_version: str | None = None
    torch_version: str | None = None
    torch_git_version: str | None = None
    torch_debug: bool | None = None
    torch_build: dict[str, Any] | None = None
    cuda_version: str | None = None
    hip_version: str | None = None
    cudnn_version: str | None = None
    nccl_version: str | None = None
    cuda_initialized: bool | None = None
    gpu_driver: str | None = None
    gpus: list[dict[str, Any]] | None = None
    cpu_model: str | None = None
    cpu_count: int | None = None
    cpu_capability: str | None = None
    cpu_flags: list[str] | None = None
    num_threads: int | None = None
    num_interop_threads: int | None = None
    omp_max_threads: int | None = None
    mkl_max_threads: int | None = None
    determinism: dict[str, Any] | None = None
    env_vars: dict[str, str | None] | None = None
    packages: dict[str, str] | None = None
    script: str | None = None
    script_sha256: str | None = None
    git_root: str | None = None
    git_commit: str | None = None
    git_dirty: bool | None = None
    git_changes: dict[str, str | None] | None = None
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (what ``env --json`` prints and run records store)."""
        out = {
            f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"
        }
        out.update(_json_value(self.extra))
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Environment:
        """Rebuild from ``to_dict()`` output; raises ``EnvFileError`` if it is not one."""
        if not isinstance(d, Mapping):
            raise EnvFileError(f"An environment must be a JSON object, got {type(d).__name__}.")
        problem = json_problem(dict(d))
        if problem is not None:
            raise EnvFileError(f"An environment must be strict JSON: {problem}.")
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        if not any(k in d for k in ("torch_version", "python_version", "collected_at")):
            raise EnvFileError(
                "This JSON object is not a torchrepro environment: it has none of the keys "
                "torch_version, python_version, collected_at (write one with `torchrepro env --json`)."
            )
        values: dict[str, Any] = {}
        for name, value in d.items():
            if name in known:
                _check_field(name, value)
                values[name] = _json_value(value)
        extra = {k: _json_value(v) for k, v in d.items() if k not in known}
        return cls(**values, extra=extra)


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "hash_randomization": (bool,),
    "torch_debug": (bool,),
    "cuda_initialized": (bool,),
    "git_dirty": (bool,),
    "cpu_count": (int,),
    "num_threads": (int,),
    "num_interop_threads": (int,),
    "omp_max_threads": (int,),
    "mkl_max_threads": (int,),
    "schema_version": (int,),
    "torch_build": (dict,),
    "determinism": (dict,),
    "env_vars": (dict,),
    "packages": (dict,),
    "git_changes": (dict,),
    "gpus": (list,),
    "cpu_flags": (list,),
}


def _check_field(name: str, value: Any) -> None:
    if value is None:
        return
    types = _FIELD_TYPES.get(name, (str,))
    if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
        expected = " or ".join(t.__name__ for t in types)
        raise EnvFileError(
            f"Field {name!r} must be {expected} or null, got {type(value).__name__}: {reprlib.repr(value)}."
        )


@dataclass(frozen=True)
class EnvDifference:
    """One differing value between two environments, classified.

    ``key`` is a dotted path (``determinism.cudnn_benchmark``, ``env_vars.OMP_NUM_THREADS``,
    ``packages.numpy``, ``gpus[0].name``); ``a``/``b`` are the values (``None`` = absent or not
    collected); ``breaks`` tells whether such a difference can change a run's bits; ``reason`` is
    the one-line reason of its class.
    """

    key: str
    a: Any
    b: Any
    breaks: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (one element of ``env diff --json``'s ``differences``)."""
        return {"key": self.key, "a": self.a, "b": self.b, "breaks": self.breaks, "reason": self.reason}
