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
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchrepro.errors import TraceError

__all__ = ["ProbeSettings", "merge_processes"]


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
    "Mapping[str, Any]": (_mapping_of(lambda _: True), "an object"),
}


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """The settings an audited script ran with, and what it seeded, compiled and loaded.

    The switches are those of :class:`torchrepro.DeterminismFlags` under the same names, read
    after each optimizer step (``warn_only``: what the script asked for; the probe runs it
    warn-only). The records (``dataloaders``, ``compile_calls``, ``tainted_seeds``, ``calls``) are
    JSON objects whose keys the rules read with defaults.

    Processes: ``optimizer_steps`` and ``backward_steps`` (``backward()`` calls that trained
    tensors no optimizer holds: a hand-written update) count this process's training; ``process``
    says which process it is (``pid``, ``parent_pid``, ``main``, ``target``, ``start_method``),
    ``started`` the processes it started (``pid``, ``location``, ``target``, ``start_method``, and
    ``started``/``joined``: positions on this process's own clock of starts, joins and shared
    updates), ``shared_modules`` its ``share_memory()`` calls and ``shared_updates`` the steps it
    made on parameters in shared memory. ``switch_statements``: the statements of the script and
    of the modules it imported from its own directory that set a determinism switch to a literal
    value (``switch``, ``value``, ``location``, the ``condition`` deciding it, whether it names
    ``cuda``), each with whether it ``ran``. ``processes`` is empty in what one process writes;
    :func:`merge_processes` fills it with one summary per process of the run.

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
    backward_steps: int = 0
    process: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    started: tuple[Mapping[str, Any], ...] = ()
    shared_modules: tuple[Mapping[str, Any], ...] = ()
    shared_updates: tuple[Mapping[str, Any], ...] = ()
    switch_statements: tuple[Mapping[str, Any], ...] = ()
    processes: tuple[Mapping[str, Any], ...] = ()
    inductor_fallback_random: bool = False
    accumulation_statements: tuple[Mapping[str, Any], ...] = ()

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


def _summary(record: ProbeSettings, start: Mapping[str, Any] | None) -> dict[str, Any]:
    """One process of a run, as ``ProbeSettings.processes`` lists it."""
    own = dict(record.process)
    start = start or {}
    return {
        "pid": own.get("pid"),
        "parent_pid": own.get("parent_pid"),
        "main": bool(own.get("main")),
        "followed": True,
        "target": start.get("target") or own.get("target"),
        "argv": own.get("argv"),
        "location": start.get("location"),
        "start_method": start.get("start_method") or own.get("start_method"),
        "started": start.get("started"),
        "joined": start.get("joined"),
        "optimizer_steps": record.optimizer_steps,
        "backward_steps": record.backward_steps,
        "torch_seeded": record.torch_seeded,
        "shared_updates": [dict(u) for u in record.shared_updates],
    }


def _trained(record: ProbeSettings) -> bool:
    return record.optimizer_steps + record.backward_steps > 0


def merge_processes(main: ProbeSettings, children: Sequence[ProbeSettings] = ()) -> ProbeSettings:
    """One record for a run's processes: the audited process (``main``) and the python children
    it (or they) started, each probed in its own process.

    - ``processes``: one summary per process, the audited one first, then the children in the
      order they were started, then the processes started but not followed (no record of their
      own: not a python that imports torchrepro with this environment, or killed before it
      wrote), with ``followed`` false and no steps;
    - the switches, seeding and thread settings are those of the process that trained: the
      audited one, unless only children trained (then the first child that trained); ``process``
      says which;
    - ``optimizer_steps`` and ``backward_steps`` are the sums over every process;
    - the records (loaders, seeds, compile calls, conditions, shared modules and updates,
      starts, switch statements: one per line, run if it ran in any process) are those of every
      process; a loader of another process than the judged one
      carries that process's ``seeded`` and ``pid``.
    """
    starts: dict[int, dict[str, Any]] = {}
    for record in (main, *children):
        for start in record.started:
            pid = start.get("pid")
            if isinstance(pid, int) and not isinstance(pid, bool):
                starts[pid] = {**start, "parent_pid": record.process.get("pid")}

    def order(record: ProbeSettings) -> tuple[int, int]:
        seq = starts.get(record.process.get("pid", -1), {}).get("started")
        return (0, seq) if isinstance(seq, int) else (1, int(record.process.get("pid") or 0))

    kids = sorted(children, key=order)
    summaries = [_summary(main, None)] + [_summary(c, starts.get(c.process.get("pid", -1))) for c in kids]
    followed = {s["pid"] for s in summaries}
    for pid, start in sorted(starts.items(), key=lambda item: (item[1].get("started") or 0, item[0])):
        if pid not in followed:
            summaries.append(
                {
                    "pid": pid,
                    "parent_pid": start.get("parent_pid"),
                    "main": False,
                    "followed": False,
                    "target": start.get("target"),
                    "argv": None,
                    "location": start.get("location"),
                    "start_method": start.get("start_method"),
                    "started": start.get("started"),
                    "joined": start.get("joined"),
                    "optimizer_steps": 0,
                    "backward_steps": 0,
                    "torch_seeded": None,
                    "shared_updates": [],
                }
            )
    judged = main
    if not _trained(main):
        judged = next((c for c in kids if _trained(c)), main)
    records = (main, *kids)

    def loaders(record: ProbeSettings) -> list[Mapping[str, Any]]:
        if record is judged:
            return list(record.dataloaders)
        pid = record.process.get("pid")
        return [{**loader, "seeded": dict(record.seeded), "pid": pid} for loader in record.dataloaders]

    statements: dict[Any, Mapping[str, Any]] = {}  # a statement ran if it ran in any process
    for record in records:
        for statement in record.switch_statements:
            key = statement.get("location")
            earlier = statements.get(key)
            ran = bool(statement.get("ran")) or bool(earlier and earlier.get("ran"))
            statements[key] = {**(earlier or statement), "ran": ran}
    calls: dict[str, Mapping[str, Any]] = {}
    for record in records:
        for call in record.calls:
            calls.setdefault(json.dumps(call, sort_keys=True, default=str), call)
    return dataclasses.replace(
        judged,
        tainted_seeds=tuple(s for r in records for s in r.tainted_seeds),
        compile_calls=tuple(c for r in records for c in r.compile_calls),
        dataloaders=tuple(loader for r in records for loader in loaders(r)),
        calls=tuple(calls.values()),
        optimizer_steps=sum(r.optimizer_steps for r in records),
        backward_steps=sum(r.backward_steps for r in records),
        started=tuple(start for r in records for start in r.started),
        shared_modules=tuple(m for r in records for m in r.shared_modules),
        shared_updates=tuple({**u, "pid": r.process.get("pid")} for r in records for u in r.shared_updates),
        switch_statements=tuple(statements.values()),
        accumulation_statements=tuple(
            {s.get("location"): s for r in records for s in r.accumulation_statements}.values()
        ),
        processes=tuple(summaries),
    )
