"""The child protocol: every setting that travels from the command line to a launched child.

Invariants:
- ``ChildSpec`` is the only place in torchrepro that names a ``TORCHREPRO_*`` environment
  variable: the parent writes them with ``to_env()``, the child reads them with ``from_env()``.
- A spec is validated when it is built (``__post_init__``), before any process or directory is
  created; ``from_env`` validates the same way, so a child never runs on a half-read spec.
- ``to_env`` also sets the process-start variables only a launcher can set (``PYTHONHASHSEED``,
  ``CUBLAS_WORKSPACE_CONFIG``, the OMP/MKL thread counts, ``ATEN_CPU_CAPABILITY``, and with
  ``portable`` ``MKL_CBWR``: ``portable.start_values``; with ``compile``, ``torch.compile``'s
  off-switches and Inductor's cache directory) and drops every ``TORCHREPRO_*`` variable of the base
  environment, so the caller's own settings never leak in.
- A recorded spec (and an audit's) puts ``SITE_DIR`` first on the child's ``PYTHONPATH``: every
  python the script starts itself is configured by ``_child.children`` (a ``PARENT_RANK_VAR``
  mark tells a child whether its ``RANK`` is its own or inherited).
- ``seed=None`` is a plain python run: nothing seeded and no pinned hash seed; switches only
  when a ``mode`` is given (a seeded spec defaults to ``strict``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torchrepro.errors import SettingsError
from torchrepro.portable import CPU_CAPABILITIES, CPU_CAPABILITY_VAR, start_values

__all__ = [
    "BACKWARD_STEPS",
    "COMPILE_CHOICES",
    "COMPILE_OFF_VARS",
    "CPU_CAPABILITIES",
    "CPU_CAPABILITY_VAR",
    "ENV_PREFIX",
    "HASH_SEED_VAR",
    "INDUCTOR_CACHE_VAR",
    "LOCATION_VARIABLES",
    "MKL_THREADS_VAR",
    "OMP_THREADS_VAR",
    "PARENT_RANK_VAR",
    "PATH_FIELDS",
    "RELAUNCHED_VAR",
    "SITE_DIR",
    "START_VARIABLES",
    "THREAD_VARS",
    "ChildSpec",
    "in_run",
    "mark_rank",
    "parent_rank",
    "python_hash_seed",
    "variable",
]

HASH_SEED_VAR = "PYTHONHASHSEED"
"""Python's hash seed: fixed when the interpreter starts, so only a launcher can set it."""
OMP_THREADS_VAR = "OMP_NUM_THREADS"
MKL_THREADS_VAR = "MKL_NUM_THREADS"
"""The thread counts OpenMP and oneMKL read when they start (``--threads`` pins both)."""
THREAD_VARS = (OMP_THREADS_VAR, MKL_THREADS_VAR)
START_VARIABLES = (HASH_SEED_VAR, *THREAD_VARS)
"""The process-start variables of Python and the CPU libraries that this module alone spells."""

ENV_PREFIX = "TORCHREPRO_"
"""Every variable of the protocol starts with this prefix."""

BACKWARD_STEPS = -1
"""``trace_optimizer`` of steps counted by ``backward()`` (training no optimizer sees)."""

RELAUNCHED_VAR = ENV_PREFIX + "RELAUNCHED"
"""Set by ``relaunch`` in the process it re-executes, so it re-executes at most once."""

PARENT_RANK_VAR = ENV_PREFIX + "PARENT_RANK"
"""Set by every process torchrepro configured (the bootstrap and the children it adopts) to the
rank it records as, or to the rank variable it started with while that is unresolved: a child
whose ``RANK`` (or ``LOCAL_RANK``) equals it inherited it, and is not that rank."""

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child", "site")
"""Holds the ``sitecustomize`` a recorded run's children find first on ``PYTHONPATH``: every
python the script starts itself (ranks, ``subprocess`` of ``sys.executable``) is configured too."""


# field name -> (variable, kind). ``kind`` says how the value is written and parsed.
_VARIABLES: dict[str, tuple[str, str]] = {
    "seed": ("SEED", "int"),
    "mode": ("MODE", "str"),
    "threads": ("THREADS", "int"),
    "record_dir": ("RECORD_DIR", "path"),
    "record_values": ("RECORD_VALUES", "int"),
    "max_steps": ("MAX_STEPS", "int"),
    "trace_step": ("TRACE_STEP", "int"),
    "trace_out": ("TRACE_OUT", "path"),
    "trace_optimizer": ("TRACE_OPTIMIZER", "int"),
    "capture_op": ("CAPTURE_OP", "int"),
    "capture_out": ("CAPTURE_OUT", "path"),
    "ops_out": ("OPS_OUT", "path"),
    "audit_settings_out": ("AUDIT_SETTINGS_OUT", "path"),
    "num_workers": ("NUM_WORKERS", "str"),
    "cpu_capability": ("CPU_CAPABILITY", "str"),
    "portable": ("PORTABLE", "bool"),
    "kill_at": ("KILL_AT", "int"),
    "resume_states": ("RESUME_STATES", "bool"),
    "compile": ("COMPILE", "str"),
    "compile_cache": ("COMPILE_CACHE", "path"),
    "compile_probe": ("COMPILE_PROBE", "bool"),
    "nnodes": ("NNODES", "int"),
    "relayed": ("RELAYED", "bool"),
    "whole_shards": ("WHOLE_SHARDS", "bool"),
}

COMPILE_CHOICES = ("eager", "compiled")
"""``ChildSpec.compile``: ``eager`` turns ``torch.compile`` off (``TORCH_COMPILE_DISABLE=1``: the
compiled wrapper stays, so module and parameter names are the compiled run's, and runs eagerly);
``compiled`` lets the script compile as it does (both off-switches removed from its environment)."""
COMPILE_OFF_VARS = ("TORCH_COMPILE_DISABLE", "TORCHDYNAMO_DISABLE")
"""The variables that turn ``torch.compile`` off (Dynamo's config, and its ``optimize``)."""
INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
TRITON_CACHE_VAR = "TRITON_CACHE_DIR"
"""Where Inductor (and Triton, on GPU) keep compiled kernels: ``compile_cache`` points both there."""

PATH_FIELDS = tuple(name for name, (_, kind) in _VARIABLES.items() if kind == "path")
"""``ChildSpec`` fields that are paths the child writes below (a check across nodes re-roots them)."""

LOCATION_VARIABLES = (
    *(ENV_PREFIX + var for var, kind in _VARIABLES.values() if kind == "path"),
    ENV_PREFIX + "TRACE_STEP",
    ENV_PREFIX + "CAPTURE_OP",
)
"""Protocol variables that only say where a child writes its records (harmless in an env diff)."""


def variable(name: str) -> str:
    """The environment variable that carries ``ChildSpec`` field ``name`` to a child.

    >>> variable("threads")
    'TORCHREPRO_THREADS'
    """
    return ENV_PREFIX + _VARIABLES[name][0]


def python_hash_seed(seed: int, *keys: int | str) -> int:
    """The ``PYTHONHASHSEED`` of a run: ``derive_seed(seed, HASH_SEED_VAR, *keys) % 2**32``.

    >>> python_hash_seed(0) == python_hash_seed(0)
    True
    >>> 0 <= python_hash_seed(2**64 - 1) < 2**32
    True
    """
    from torchrepro.seeding import derive_seed

    return derive_seed(seed, HASH_SEED_VAR, *keys) % 2**32


def _count(name: str, value: object, minimum: int, what: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SettingsError(f"{name} must be {what}, an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ChildSpec:
    """What a launched child does besides running the script; see the module invariants.

    ``num_workers``: ``"other"`` maps every DataLoader's ``num_workers`` to a different value
    (0 -> 2, n -> 0; ``check --vary workers``), a number pins it. ``hash_seed`` overrides the
    derived ``PYTHONHASHSEED`` (``--vary hashseed``). ``cpu_capability`` pins the CPU ISA torch
    dispatches to (``ATEN_CPU_CAPABILITY``). ``portable``: the child starts with portable mode's
    variables (``portable.start_values``: ``MKL_CBWR``, the CPU ISA) and turns oneDNN off before the
    script runs. ``trace_step``/``trace_out`` trace the ops of step
    ``trace_step`` of optimizer ``trace_optimizer`` to ``<trace_out>.rank<R>``; ``ops_out`` records
    every op (the audit) to ``<ops_out>.rank<R>.json``; ``capture_op``/``capture_out`` (with a
    trace) save the inputs of the traced op at that index of the trace to ``<capture_out>.rank<R>.*``
    (``check --repro``); ``max_steps`` ends the run with exit code
    0 after that many optimizer steps. ``kill_at=K``: before its (K+1)-th step the first optimizer
    notes ``runrecord.killpoint_path`` and waits for the check to kill the run (``check --vary
    resume``); ``resume_states``: note the RNG states before every step of the first optimizer,
    and the parameters and optimizer state before the first one (``runrecord.states_path``).
    ``compile`` (``COMPILE_CHOICES``): run the script eager or compiled (``check --vary compile``),
    ``compile_cache``: Inductor's cache directory (a check's own, so no run reads or writes the
    user's), ``compile_probe``: with ``trace_step``, that step's compiled graphs are compared with
    eager runs of the same graphs (``tracing.compiled``) instead of tracing ops, which compiled code
    does not dispatch one by one. ``nnodes``: the run's ranks span that many nodes (``nodes``); at
    exit every rank ships its record files to the node holding global rank 0 (``_child.ship``),
    and each node's local rank 0 records the node's environment (``runrecord.node_env_path``);
    ``relayed``: a check across nodes forwards the records itself (``check_nodes``): no rank ships.
    ``whole_shards``: sharded tensors (FSDP2's DTensors) are recorded whole, gathered from every
    rank, so runs on different numbers of processes compare (``check --vary world``).
    """

    seed: int | None = None
    mode: str | None = None
    threads: int | None = None
    record_dir: str | None = None
    record_values: int | None = None
    max_steps: int | None = None
    trace_step: int | None = None
    trace_out: str | None = None
    trace_optimizer: int = 0
    capture_op: int | None = None
    capture_out: str | None = None
    ops_out: str | None = None
    audit_settings_out: str | None = None
    num_workers: str | None = None
    cpu_capability: str | None = None
    hash_seed: int | None = None
    portable: bool = False
    kill_at: int | None = None
    resume_states: bool = False
    compile: str | None = None
    compile_cache: str | None = None
    compile_probe: bool = False
    nnodes: int | None = None
    relayed: bool = False
    whole_shards: bool = False

    def __post_init__(self) -> None:
        from torchrepro.flags import MODES
        from torchrepro.seeding import validate_seed

        if self.seed is not None:
            try:
                validate_seed(self.seed)
            except ValueError as exc:  # a wrong type stays a TypeError
                raise SettingsError(str(exc)) from None
            if self.mode is None:
                object.__setattr__(self, "mode", "strict")
        if self.mode is not None and self.mode not in MODES:
            raise SettingsError(f"mode must be one of {MODES}, got {self.mode!r}")
        _count("threads", self.threads, 1, "a thread count")
        _count("record_values", self.record_values, 0, "a number of values")
        _count("max_steps", self.max_steps, 1, "a number of optimizer steps")
        _count("kill_at", self.kill_at, 1, "a number of optimizer steps")
        _count("nnodes", self.nnodes, 1, "a number of nodes")
        _count("trace_step", self.trace_step, 0, "an optimizer step index (0 is the first step)")
        _count(
            "trace_optimizer", self.trace_optimizer, BACKWARD_STEPS, "an optimizer index (-1: backward steps)"
        )
        if self.hash_seed is not None and not (
            isinstance(self.hash_seed, int)
            and not isinstance(self.hash_seed, bool)
            and 0 <= self.hash_seed < 2**32
        ):
            raise SettingsError(f"hash_seed must be an integer in [0, 2**32), got {self.hash_seed!r}")
        if (self.trace_step is None) != (self.trace_out is None):
            raise SettingsError("trace_step and trace_out go together: give both or neither")
        _count("capture_op", self.capture_op, 0, "an op index in the trace")
        if (self.capture_op is None) != (self.capture_out is None):
            raise SettingsError("capture_op and capture_out go together: give both or neither")
        if self.capture_op is not None and self.trace_step is None:
            raise SettingsError("capture_op captures an op of the traced step: give trace_step too")
        if self.num_workers is not None and not re.fullmatch(r"other|[0-9]+", self.num_workers):
            raise SettingsError(f"num_workers must be 'other' or a count >= 0, got {self.num_workers!r}")
        if self.compile is not None and self.compile not in COMPILE_CHOICES:
            raise SettingsError(f"compile must be one of {COMPILE_CHOICES}, got {self.compile!r}")
        if self.compile_probe and self.trace_step is None:
            raise SettingsError(
                "compile_probe compares the compiled graphs of the traced step: give trace_step"
            )
        for flag in ("portable", "resume_states", "compile_probe", "relayed", "whole_shards"):
            if not isinstance(getattr(self, flag), bool):
                raise SettingsError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.cpu_capability is not None and self.cpu_capability not in CPU_CAPABILITIES:
            raise SettingsError(
                f"cpu_capability must be one of {CPU_CAPABILITIES}, got {self.cpu_capability!r}"
            )
        for name in (
            "record_dir",
            "trace_out",
            "capture_out",
            "ops_out",
            "audit_settings_out",
            "compile_cache",
        ):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, os.fspath(value))

    @property
    def seeded(self) -> bool:
        """Whether the child seeds every RNG and sets the switches (``torchrepro run``)."""
        return self.seed is not None

    def to_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The child's environment: ``base`` (default ``os.environ``) plus this spec.

        >>> env = ChildSpec(seed=3, threads=2).to_env({"PATH": "/bin", "TORCHREPRO_SEED": "9"})
        >>> env["TORCHREPRO_SEED"], env["TORCHREPRO_MODE"], env["OMP_NUM_THREADS"]
        ('3', 'strict', '2')
        >>> ChildSpec().to_env({"PATH": "/bin"})
        {'PATH': '/bin'}

        A recorded spec (``record_dir``), or an audit's (``audit_settings_out``), also puts
        ``SITE_DIR`` first on ``PYTHONPATH`` (the base's entries kept after it), so the python
        processes the script starts are recorded (audited) too.
        """
        from torchrepro.flags import CUBLAS_CONFIGS, CUBLAS_VAR

        env = {
            k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(ENV_PREFIX)
        }
        for name, (var, _) in _VARIABLES.items():
            value = getattr(self, name)
            if value is None or value is False or (name == "trace_optimizer" and self.trace_step is None):
                continue
            env[ENV_PREFIX + var] = "1" if value is True else str(value)
        if self.seed is not None:
            hash_seed = python_hash_seed(self.seed) if self.hash_seed is None else self.hash_seed
            env[HASH_SEED_VAR] = str(hash_seed)
            env[CUBLAS_VAR] = CUBLAS_CONFIGS[0]
        elif self.hash_seed is not None:
            env[HASH_SEED_VAR] = str(self.hash_seed)
        if self.threads is not None:
            env[OMP_THREADS_VAR] = env[MKL_THREADS_VAR] = str(self.threads)
        if self.cpu_capability is not None:
            env[CPU_CAPABILITY_VAR] = self.cpu_capability
        if self.portable:
            env.update(start_values(env, cpu_capability=self.cpu_capability))
        if self.compile is not None:
            for var in COMPILE_OFF_VARS:
                env.pop(var, None)
            if self.compile == "eager":
                env[COMPILE_OFF_VARS[0]] = "1"
        if self.compile_cache is not None:
            env[INDUCTOR_CACHE_VAR] = self.compile_cache
            env[TRITON_CACHE_VAR] = os.path.join(self.compile_cache, "triton")
        if self.record_dir is not None or self.audit_settings_out is not None:
            entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
            env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *entries])
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ChildSpec:
        """Read the spec a parent wrote (``SettingsError`` naming the variable when one is malformed)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, (var, kind) in _VARIABLES.items():
            text = env.get(ENV_PREFIX + var)
            if text is None or text == "":
                continue
            if kind == "bool":
                if text not in ("0", "1"):
                    raise SettingsError(f"{ENV_PREFIX + var} must be 0 or 1, got {text!r}")
                values[name] = text == "1"
            elif kind == "int":
                try:
                    values[name] = int(text)
                except ValueError:
                    raise SettingsError(f"{ENV_PREFIX + var} must be an integer, got {text!r}") from None
            else:
                values[name] = text
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"malformed {ENV_PREFIX}* settings in the environment: {exc}") from None

    def replace(self, **changes: Any) -> ChildSpec:
        """A copy with ``changes`` (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ChildSpec(**values)


def in_run(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (default ``os.environ``) carries the protocol of a recorded run or of
    an audit (a process started by torchrepro, or by a script torchrepro runs). Imports nothing."""
    env = os.environ if environ is None else environ
    return bool(env.get(ENV_PREFIX + "RECORD_DIR") or env.get(ENV_PREFIX + "AUDIT_SETTINGS_OUT"))


def parent_rank(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``PARENT_RANK_VAR`` mark the process that started this one left (None: none)."""
    return (os.environ if environ is None else environ).get(PARENT_RANK_VAR)


def mark_rank(rank: str) -> None:
    """Leave the mark of this process's rank (``""``: none) for the processes it starts."""
    os.environ[PARENT_RANK_VAR] = rank
