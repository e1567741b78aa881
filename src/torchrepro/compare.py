"""The first divergence between two run records (or two live event streams).

Invariants:
- Two runs agree at an event iff their events at the same position on the same rank have the
  same ``kind``, ``key``, ``step`` and fingerprint; the first divergence of a rank is the first
  position where they do not (a missing event where the other run has one counts).
- Across ranks the reported divergence is the earliest among the ranks' first divergences by the
  one rule ``events.divergence_order``, which ``check`` uses too; its ``kind`` is that of the
  first run's event at that position, unless the two runs did different things there (another
  kind or key) and the second run's event has the earlier step: then the divergence is that
  event's.
- Records are read through ``runrecord`` (incrementally for live files: ``EventTail``).
- Runs on different numbers of processes (``check --vary world``; ``compare`` of records whose
  world sizes differ) are compared as ``WorldScope`` says: rank 0 of the run on fewer processes
  against every rank of the other, in the events that must not depend on how a global batch is
  split (``events.world_invariant``; the state at exit stepped by optimizer steps, not by
  ``backward()`` calls) and in nothing else; their op traces are never compared (the
  processes compute different parts of each global batch).
- The first differing tensor's largest absolute difference counts equal values (equal
  infinities, NaN in both runs) as no difference; NaN or an infinity against another value is
  an unbounded difference (``nonfinite``, ``max_abs_diff`` None), so every result is strict JSON.
- A ``compute`` divergence at step k is located (op, module, line, rank) from op traces of step k
  (``trace-step<k>.rank<R>`` files, written by ``torchrepro run --trace-step k``) by one code path,
  ``locate_in_traces``, shared with ``torchrepro check``; locating never changes the verdict, and
  traces that could not be compared are never reported as matching.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from torchrepro.errors import EnvFileError, ReproError
from torchrepro.events import (
    FINAL_KEY,
    counted_kind,
    describe_name,
    earliest,
    is_optimizer_key,
    optimizer_index,
    optimizer_key,
    world_invariant,
)
from torchrepro.runrecord import (
    COMMAND_FILE,
    ENV_FILE,
    RunRecord,
    load_run,
    read_json,
    read_uncovered,
    read_world,
)

__all__ = [
    "FINAL_NOT_LOCATED",
    "UNRECORDED_REASON",
    "WORLD_NOT_LOCATED",
    "Comparison",
    "Coverage",
    "Divergence",
    "RankCursor",
    "WorldScope",
    "compare_runs",
    "coverage",
    "final_state_reason",
    "first_divergence",
    "locate_in_traces",
    "optimizer_steps",
    "world_cursor",
]


@dataclass(frozen=True)
class Divergence:
    """Where two runs first part: ``kind`` (init/data/compute/record), ``step``, ``rank``.

    ``op``, ``module`` and ``location`` name the source operation when it was located (else
    None; for a ``data`` divergence ``location`` is where the script created the DataLoader);
    ``key`` says which optimizer (``optimizer0``), loader (``loader0``), recorded name, or
    ``backward`` (steps no optimizer sees) the event belongs to; ``name`` which tensor of it
    differs first: ``param:<path>``, ``grad:<path>``, ``state:<path>:<key>``, a batch field
    (``[0]``, ``["input_ids"]``), with ``shape`` and ``dtype``.
    """

    step: int
    rank: int
    kind: str
    op: str | None = None
    module: str | None = None
    location: str | None = None
    key: str | None = None
    index: int = 0
    name: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    unmatched: bool = False
    """The runs did different things here (one has no event, or an event of another kind or key),
    rather than the same thing with other values."""

    def to_dict(self) -> dict[str, Any]:
        """The ``first_divergence`` object of the ``check --json`` verdict."""
        return {
            "step": self.step,
            "rank": self.rank,
            "kind": self.kind,
            "op": self.op,
            "module": self.module,
            "location": self.location,
            "key": self.key,
            "name": self.name,
            "shape": None if self.shape is None else list(self.shape),
            "dtype": self.dtype,
        }

    @property
    def final_state(self) -> bool:
        """Whether the runs part in the state at exit (the ``final`` event), not in a recorded step."""
        return counted_kind(self.kind, self.key) == FINAL_KEY

    def final_module(self) -> str | None:
        """The variable of ``__main__`` holding the module whose final state differs (``model``)."""
        prefix = f"{FINAL_KEY}:"
        if not self.final_state or not self.name or not self.name.startswith(prefix):
            return None
        return self.name[len(prefix) :].split(".", 1)[0] or None

    def what(self) -> str | None:
        """The differing tensor in words: ``gradient of fc.weight``, ``batch field [0] float32[4, 3]``."""
        if self.name is None:
            return None
        typed = "" if self.dtype is None or self.shape is None else f" {self.dtype}{list(self.shape)}"
        return describe_name(self.name, self.kind) + typed


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(
        a["kind"] == b["kind"] and a["key"] == b["key"] and a["step"] == b["step"] and a["fp"] == b["fp"]
    )


class _WorldEvents(Sequence[dict[str, Any]]):
    """The events of one rank that must not depend on the world size (``events.world_invariant``),
    read as a live list grows. The state at exit is stepped by the optimizer steps before it (its
    recorded step counts ``backward()`` calls when no optimizer stepped: one per micro-batch)."""

    def __init__(self, events: Sequence[dict[str, Any]]) -> None:
        self._events = events
        self._kept: list[dict[str, Any]] = []
        self._read = 0
        self._steps = 0  # optimizer steps of the first optimizer read so far

    def _catch_up(self) -> list[dict[str, Any]]:
        while self._read < len(self._events):
            event = self._events[self._read]
            self._read += 1
            kind, key = str(event["kind"]), event.get("key")
            if not world_invariant(kind, key):
                continue
            if kind == "compute" and key == optimizer_key(0):
                self._steps += 1
            elif counted_kind(kind, key) == FINAL_KEY:
                event = {**event, "step": self._steps}
            self._kept.append(event)
        return self._kept

    def __len__(self) -> int:
        return len(self._catch_up())

    def __getitem__(self, i: Any) -> Any:
        return self._catch_up()[i]


class RankCursor:
    """Compares one rank of two runs event by event as the events arrive (``a`` and ``b`` may
    grow between calls; ``world_cursor`` gives it views of them)."""

    def __init__(self, rank: int, a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> None:
        self.rank = rank
        self.a = a
        self.b = b
        self.position = 0
        self.divergence: Divergence | None = None
        self.max_step_compared = -1
        self.compared: dict[str, int] = {}
        """Events compared so far, per kind (the diverging one included; the ``compute`` event of
        the state at exit counts as ``final``)."""
        self.optimizer_steps: dict[str, int] = {}
        """Optimizer steps compared so far, per optimizer key (the diverging one included)."""

    def advance(self, *, a_done: bool = False, b_done: bool = False) -> Divergence | None:
        """Compare every event both sides now have; with ``*_done`` a missing event diverges."""
        while self.divergence is None:
            i = self.position
            has_a, has_b = i < len(self.a), i < len(self.b)
            if has_a and has_b:
                ea, eb = self.a[i], self.b[i]
                counted = counted_kind(ea["kind"], ea["key"])
                self.compared[counted] = self.compared.get(counted, 0) + 1
                if counted == "compute":
                    self.max_step_compared = max(self.max_step_compared, ea["step"])
                    if is_optimizer_key(ea["key"]):
                        self.optimizer_steps[ea["key"]] = self.optimizer_steps.get(ea["key"], 0) + 1
                if not _same(ea, eb):
                    self.divergence = _divergence(ea, eb, self.rank, i)
                    break
                self.position += 1
            elif has_a and b_done:
                self.divergence = _divergence(self.a[i], None, self.rank, i)
            elif has_b and a_done:
                self.divergence = _divergence(None, self.b[i], self.rank, i)
            else:
                break
        return self.divergence


def _divergence(a: dict[str, Any] | None, b: dict[str, Any] | None, rank: int, index: int) -> Divergence:
    event = a if a is not None else b
    assert event is not None
    kind, step = event["kind"], event["step"]
    # The runs did different things here: report the earlier of the two in step order.
    different = a is not None and b is not None and (a["kind"], a["key"]) != (b["kind"], b["key"])
    if different and b is not None and b["step"] < step:
        kind, step, event = b["kind"], b["step"], b
    name = shape = dtype = None
    if a is not None and b is not None and not different:
        leaf = _first_differing_leaf(a, b)
        if leaf is not None:
            name, shape, dtype = leaf.get("n", ""), tuple(leaf["shape"]), str(leaf["dtype"])
    source = event.get("src") if kind == "data" else None
    return Divergence(
        step=int(step),
        rank=rank,
        kind=str(kind),
        key=str(event["key"]),
        index=index,
        location=source if isinstance(source, str) else None,
        name=name,
        shape=shape,
        dtype=dtype,
        unmatched=a is None or b is None or different,
    )


def _first_differing_leaf(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """The first tensor entry of ``a`` that differs from ``b``'s (by fingerprint or structure)."""
    ta, tb = a.get("t", []), b.get("t", [])
    for la, lb in zip(ta, tb, strict=False):
        if la["fp"] != lb["fp"] or la.get("n") != lb.get("n"):
            return dict(la)
    if len(ta) > len(tb):
        return dict(ta[len(tb)])
    return None


def first_divergence(a: list[dict[str, Any]], b: list[dict[str, Any]], *, rank: int = 0) -> Divergence | None:
    """The first divergence between two complete event lists of one rank (None: identical)."""
    return RankCursor(rank, a, b).advance(a_done=True, b_done=True)


def world_cursor(rank: int, a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> RankCursor:
    """A cursor comparing two runs on different numbers of processes in the events that must not
    depend on the world size: one side is rank 0 of the run on fewer processes, the other rank
    ``rank`` of the run on more (``WorldScope``); ``position`` counts those events."""
    return RankCursor(rank, _WorldEvents(a), _WorldEvents(b))


WORLD_COMPARED: Final = (
    ("init", "the parameters each optimizer is given"),
    ("compute", "the gradients, optimizer state and parameters of each optimizer step"),
    ("final", "the state at exit"),
)
"""What a comparison across world sizes compares (``events.world_invariant``), in words."""

WORLD_NOT_COMPARED: Final = (
    ("data", "batches (each process loads its own part of a global batch)"),
    ("record", "recorded values (a script may record a process's own, e.g. its loss)"),
    ("backward", "backward() steps (one per micro-batch, so their number depends on the split)"),
)
"""What a comparison across world sizes leaves out, and why."""

WORLD_FIX: Final = (
    "train with torchrepro.SeededLoader(global_batch_size=...) and torchrepro.InvariantDataParallel, "
    "which make every optimizer step the same bits on any number of processes dividing the "
    "global batch's micro-batches"
)

WORLD_NOT_LOCATED: Final = (
    "not located: op traces of runs on different numbers of processes are not compared op by op "
    "(each process computes another part of every global batch); the step and tensor above say "
    "where the runs part"
)
"""The note of a divergence across world sizes (locating compares op traces of equal splits)."""


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


@dataclass(frozen=True)
class WorldScope:
    """A comparison across world sizes: rank 0 of the run on ``reference`` processes against every
    rank of the run(s) on ``other`` processes, in the events that must hold the same bits whatever
    the split of a global batch (``WORLD_COMPARED``) and in nothing else (``WORLD_NOT_COMPARED``).
    """

    reference: int
    other: int

    @property
    def varied(self) -> str:
        """What differs between the runs, in words (``1 vs 2 processes``)."""
        return f"{self.reference} vs {_processes(self.other)}"

    def to_dict(self) -> dict[str, Any]:
        """The ``world`` object of ``check --json`` and ``compare --json``."""
        return {
            "processes": [self.reference, self.other],
            "reference_rank": 0,
            "compared": [kind for kind, _ in WORLD_COMPARED],
            "not_compared": [kind for kind, _ in WORLD_NOT_COMPARED],
        }

    def describe(self) -> str:
        """One line for people: which ranks were compared against which, what was and what was not."""
        compared = "; ".join(text for _, text in WORLD_COMPARED)
        left_out = "; ".join(text for _, text in WORLD_NOT_COMPARED)
        return (
            f"across world sizes: rank 0 of the run on {_processes(self.reference)} against every rank "
            f"of the run on {_processes(self.other)}; compared: {compared}; not compared: {left_out}"
        )

    def divergence_reason(self, d: Divergence) -> str:
        """Why the runs part at ``d``, in words, with the fix."""
        between = f"between {self.reference} and {_processes(self.other)}"
        on = f" (rank {d.rank} of the run on {_processes(self.other)})"
        if d.final_state:
            module = d.final_module() or "a module the script holds"
            return (
                f"the state at exit of {module} differs {between}{on} although every optimizer step "
                "compared matched: something changed outside the optimizer steps depends on the world "
                "size (e.g. BatchNorm running statistics updated by each process on its own micro-batches, "
                f"or weights changed by hand); {WORLD_FIX}"
            )
        if d.kind == "init":
            return (
                f"the parameters given to {d.key} differ {between}{on}: the initial weights depend on "
                "the number of processes; build the model the same way on every rank (seeded before it "
                "is built), or broadcast it from rank 0 as DDP and torchrepro.InvariantDataParallel do"
            )
        part = (d.name or "").partition(":")[0]
        if d.unmatched:
            return (
                f"the runs did not take the same optimizer steps {between}{on}: at step {d.step} one "
                "took a step the other did not, so the number of optimizer steps depends on the world "
                f"size; iterate whole global batches: {WORLD_FIX}"
            )
        if part == "grad":
            return (
                f"the parameters after optimizer step {d.step} differ {between}{on}: the gradients the "
                "step used already differ, so the script's gradients depend on how the global "
                f"batch is split across processes; {WORLD_FIX}"
            )
        if d.name is None:
            return f"optimizer step {d.step} differs {between}{on}: {WORLD_FIX}"
        return (
            f"the parameters after optimizer step {d.step} differ {between}{on} although the gradients "
            "the step used are equal: the update itself depends on the number of processes "
            "(e.g. a learning rate or an optimizer option computed from the world size)"
        )

    def inconclusive_reason(self, covered: Coverage) -> str:
        """The headline of a comparison across world sizes in which no optimizer step was compared
        on some rank (``covered`` is not conclusive)."""
        what = (
            f"rank(s) {', '.join(map(str, covered.uncovered_ranks))} of the run on {_processes(self.other)}"
            if len(covered.uncovered_ranks) < len(covered.ranks_expected)
            else "any rank"
        )
        return (
            f"no optimizer step was compared on {what}: across world sizes only the parameters given "
            "to an optimizer, each optimizer step and the state at exit are compared (batches, "
            "recorded values and backward() steps depend on the split), and the script took no "
            "optimizer step torchrepro records"
        )


@dataclass(frozen=True)
class TensorDifference:
    """The first differing tensor of a diverging event; its largest absolute difference if stored.

    ``max_abs_diff`` is None when no values were stored, or when the difference is unbounded:
    ``nonfinite`` is then True (an element is NaN or infinite in one run and another value in the
    other, or ``|a-b|`` overflows). ``sampled``: the tensor was too large for all its values to be
    stored, and ``max_abs_diff`` is the largest difference among the evenly spaced sample the
    recorder keeps (``recorder.SAMPLE_SIZE``): a lower bound, 0.0 when the sample is equal.
    """

    leaf: int
    shape: list[int]
    dtype: str
    max_abs_diff: float | None
    nonfinite: bool = False
    name: str | None = None
    """The tensor's recorded name (``grad:fc.weight``, ``[0]``...), if it has one."""
    sampled: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (strict JSON: never NaN or an infinity)."""
        return {
            "leaf": self.leaf,
            "name": self.name,
            "shape": self.shape,
            "dtype": self.dtype,
            "max_abs_diff": self.max_abs_diff,
            "nonfinite": self.nonfinite,
            "sampled": self.sampled,
        }

    def describe_difference(self) -> str:
        """The largest difference in words (``1.2e-07``, ``at least 3e-05 (8 sampled values)``)."""
        if self.nonfinite:
            return "not finite (NaN or infinity in one run against another value, or an overflow)"
        if self.max_abs_diff is None:
            return "not stored (tensor too large)"
        if self.sampled:
            if self.max_abs_diff == 0:
                return "not seen (the values sampled from this large tensor are equal)"
            return f"at least {self.max_abs_diff:.3g} (from sampled values of this large tensor)"
        return f"{self.max_abs_diff:.3g}"


@dataclass(frozen=True)
class SettingDifference:
    """One way two runs were started differently: a ``settings.json`` field or the command line.

    ``detail`` says what the difference means where the bare values would mislead (a thread count
    is a setting, not nondeterminism).
    """

    name: str
    a: Any
    b: Any
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "a": self.a, "b": self.b}

    def describe(self) -> str:
        a, b = (
            _UNSET.get(self.name, "not set") if v in (None, False) else "on" if v is True else repr(v)
            for v in (self.a, self.b)
        )
        detail = f" ({self.detail})" if self.detail else ""
        return f"started with different {self.name}: {a} vs {b}{detail}"


_UNSET = {
    "threads": "not pinned",
    "OMP_NUM_THREADS": "unset",
    "vary": "none",
    "portable": "off",
    "MKL_CBWR": "unset",
    "ATEN_CPU_CAPABILITY": "unset",
}
"""How a setting that was not given reads (``None`` among a record's settings)."""

_THREADS_DETAIL = (
    "a settings difference, not nondeterminism: CPU reductions split across another number of "
    "threads can round differently; give both runs the same --threads"
)

_PORTABLE_DETAIL = (
    "a settings difference, not nondeterminism: portable mode (oneMKL's strict reproducibility, "
    "a fixed CPU instruction set, oneDNN off) runs other CPU kernels; give both runs the same --portable"
)

# settings.json fields that change what a run computes (not the run's index or what was traced)
_COMPARED_SETTINGS = (
    "seed",
    "mode",
    "threads",
    "nproc",
    "script",
    "module",
    "cpu_capability",
    "steps",
    "vary",
    "PYTHONHASHSEED",
    "OMP_NUM_THREADS",
    "portable",
    "MKL_CBWR",
    "ATEN_CPU_CAPABILITY",
)


def setting_differences(a: RunRecord, b: RunRecord) -> tuple[SettingDifference, ...]:
    """The settings and command-line arguments two records were started with differently."""
    found = []
    if a.settings is not None and b.settings is not None:
        for name in _COMPARED_SETTINGS:
            va, vb = getattr(a.settings, name), getattr(b.settings, name)
            if va != vb and not (name == "portable" and not va and not vb):  # False: an older record's None
                found.append(SettingDifference(name, va, vb))
        if found and found[0].name == "seed":  # the hash seed is derived from the seed: one cause
            found = [d for d in found if d.name != "PYTHONHASHSEED"]
        if any(d.name == "threads" for d in found):  # --threads sets OMP_NUM_THREADS: one cause
            found = [
                replace(d, detail=_threads_detail(a, b)) if d.name == "threads" else d
                for d in found
                if d.name != "OMP_NUM_THREADS"
            ]
        names = {d.name for d in found}
        if "portable" in names:  # --portable sets MKL_CBWR and the CPU ISA: one cause
            found = [
                replace(d, detail=_PORTABLE_DETAIL) if d.name == "portable" else d
                for d in found
                if d.name not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY")
            ]
        elif "cpu_capability" in names:  # --cpu-capability sets ATEN_CPU_CAPABILITY
            found = [d for d in found if d.name != "ATEN_CPU_CAPABILITY"]
    argv_a, argv_b = _script_args(a), _script_args(b)
    if argv_a is not None and argv_b is not None and argv_a != argv_b:
        found.append(SettingDifference("arguments", " ".join(argv_a), " ".join(argv_b)))
    return tuple(found)


def _threads_detail(a: RunRecord, b: RunRecord) -> str:
    """What a ``--threads`` difference means; when both environments show the count in use."""
    used = [None if run.env is None else run.env.get("num_threads") for run in (a, b)]
    if used[0] is not None and used[0] == used[1] and isinstance(used[0], int):
        return f"{_THREADS_DETAIL}; both runs used {used[0]} threads, so here it changed nothing"
    return _THREADS_DETAIL


def _varied_threads(started: Sequence[SettingDifference]) -> str | None:
    """A thread-count difference in the words ``locate_in_traces`` takes (else None)."""
    for d in started:
        if d.name == "threads":
            a, b = (
                f"{v} thread{'s' if v != 1 else ''}" if v is not None else "unpinned threads"
                for v in (d.a, d.b)
            )
            return f"between {a} (run A) and {b} (run B)"
    return None


def _explained_env_keys(setting: str) -> tuple[str, ...]:
    """The environment keys (``env_diff`` keys, or their prefixes) a setting difference sets."""
    from torchrepro._child.spec import CPU_CAPABILITY_VAR, variable
    from torchrepro.portable import CBWR_VAR

    threads = (
        "num_threads",
        "omp_max_threads",
        "mkl_max_threads",
        "env_vars.OMP_NUM_THREADS",
        "env_vars.MKL_NUM_THREADS",
        f"env_vars.{variable('threads')}",
    )
    hash_seed = ("env_vars.PYTHONHASHSEED",)
    isa = (f"env_vars.{variable('cpu_capability')}", f"env_vars.{CPU_CAPABILITY_VAR}", "cpu_capability")
    cbwr = (f"env_vars.{CBWR_VAR}",)
    table: dict[str, tuple[str, ...]] = {
        "seed": (f"env_vars.{variable('seed')}", *hash_seed),
        "mode": (f"env_vars.{variable('mode')}", "determinism"),
        "threads": threads,
        "OMP_NUM_THREADS": threads,
        "cpu_capability": isa,
        "ATEN_CPU_CAPABILITY": isa,
        "MKL_CBWR": cbwr,
        "portable": (
            f"env_vars.{variable('portable')}",
            *cbwr,
            *isa,
            "determinism.mkldnn_enabled",
        ),
        "PYTHONHASHSEED": hash_seed,
        "steps": (f"env_vars.{variable('max_steps')}",),
        "vary": (f"env_vars.{variable('num_workers')}", *hash_seed, *threads),
    }
    return table.get(setting, ())


def explaining_setting(key: str, started: Sequence[SettingDifference]) -> str | None:
    """The setting difference (``threads``...) that set the environment difference ``key``, if any."""
    for d in started:
        if any(key == k or key.startswith((k + ".", k + "[")) for k in _explained_env_keys(d.name)):
            return d.name
    return None


def is_volatile(key: str) -> bool:
    """Whether an environment difference exists between any two records: when each was collected,
    where each run wrote its record. Never a cause; ``compare`` leaves them out of its report."""
    from torchrepro._child.spec import LOCATION_VARIABLES

    return key == "collected_at" or key in {f"env_vars.{v}" for v in LOCATION_VARIABLES}


def _script_args(run: RunRecord) -> list[str] | None:
    """The arguments after the script (or module) in a record's ``command.json``, if readable."""
    try:
        command = read_json(os.path.join(run.path, COMMAND_FILE))
    except ReproError:
        return None
    argv = command.get("argv") if isinstance(command, dict) else None
    if not isinstance(argv, list) or not all(isinstance(x, str) for x in argv):
        return None
    target = run.settings.script or run.settings.module if run.settings is not None else None
    for i, arg in enumerate(argv):
        if target is not None and (arg == target or os.path.basename(arg) == os.path.basename(target)):
            return argv[i + 1 :]
    return argv


@dataclass(frozen=True)
class Comparison:
    """The verdict of comparing two runs, with the environment differences that may explain it."""

    reproducible: bool | None
    steps_compared: int
    first_divergence: Divergence | None
    coverage: Coverage | None = None
    """What was compared; ``reproducible`` is None (inconclusive) when it is not conclusive."""
    env_differences: list[Any] = field(default_factory=list)
    tensor: TensorDifference | None = None
    notes: tuple[str, ...] = ()
    """How the runs were started differently, python processes that trained unrecorded, why the
    environments were not compared, and what locating the source op did or could not do."""
    setting_differences: tuple[SettingDifference, ...] = ()
    """How the two runs were started differently (command line, seed, mode, threads, vary...),
    the likeliest cause of a divergence; also the first ``notes``."""
    optimizer_steps: dict[str, int] = field(default_factory=dict)
    """Optimizer steps compared per optimizer key (``optimizer0``...), in optimizer order."""
    reason: str | None = None
    """In one line, why the verdict is inconclusive, or that the runs differ only in the final
    state (the training that changed it was not recorded), or, for runs on different numbers of
    processes, why they part; None otherwise."""
    world: WorldScope | None = None
    """Set when the runs ran on different numbers of processes: what was compared then."""

    def to_dict(self) -> dict[str, Any]:
        """The ``compare --json`` object: the check verdict, ``env_differences``, ``tensor``, ``notes``
        (and ``world`` when the runs ran on different numbers of processes).

        Each environment difference also says whether it exists between any two records
        (``volatile``: when and where each was recorded) and which setting difference set it
        (``setting``, e.g. ``threads``; else None).
        """
        d = {
            "reproducible": self.reproducible,
            "runs": 2,
            "steps_compared": self.steps_compared,
            "optimizer_steps": sum(self.optimizer_steps.values()),
            "steps_per_optimizer": dict(self.optimizer_steps),
            "first_divergence": None if self.first_divergence is None else self.first_divergence.to_dict(),
            "inconclusive": self.reproducible is None,
            "reason": self.reason,
            "coverage": None if self.coverage is None else self.coverage.to_dict(),
            "env_differences": [
                env_difference_dict(d, self.setting_differences) for d in self.env_differences
            ],
            "tensor": None if self.tensor is None else self.tensor.to_dict(),
            "notes": list(self.notes),
        }
        if self.world is not None:  # runs on different numbers of processes
            d["world"] = self.world.to_dict()
        return d


def env_difference_dict(d: Any, started: Sequence[SettingDifference] = ()) -> dict[str, Any]:
    to_dict = getattr(d, "to_dict", None)
    result = to_dict() if callable(to_dict) else None
    if not isinstance(result, dict):
        result = {k: getattr(d, k, None) for k in ("key", "a", "b", "breaks", "reason")}
    key = str(result.get("key"))
    return {**result, "volatile": is_volatile(key), "setting": explaining_setting(key, started)}


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


@dataclass(frozen=True)
class Coverage:
    """What a comparison covered: events compared per rank and kind, and the ranks with none.

    A verdict of "identical" is conclusive only when something beyond ``init`` was compared
    (a batch, an optimizer step or a recorded value) and every rank was covered: a script that
    updates weights without ``torch.optim``, or a rank that wrote no record, is not a pass.
    """

    per_rank: dict[int, dict[str, int]]
    ranks_expected: tuple[int, ...]

    @property
    def per_kind(self) -> dict[str, int]:
        """Events compared per kind, summed over ranks."""
        total: dict[str, int] = {}
        for counts in self.per_rank.values():
            for kind, n in counts.items():
                total[kind] = total.get(kind, 0) + n
        return {kind: total[kind] for kind in sorted(total)}

    @property
    def uncovered_ranks(self) -> tuple[int, ...]:
        """Expected ranks where nothing beyond ``init`` (and the state at exit) was compared."""
        return tuple(
            r
            for r in self.ranks_expected
            if not any(n for kind, n in self.per_rank.get(r, {}).items() if kind not in ("init", FINAL_KEY))
        )

    @property
    def conclusive(self) -> bool:
        """Whether an "identical" verdict may be claimed from what was compared."""
        return bool(self.ranks_expected) and not self.uncovered_ranks

    def inconclusive_note(self, *, unrecorded: bool = False) -> str:
        """Why an "identical" verdict cannot be claimed (for a coverage that is not conclusive).

        ``unrecorded``: processes the script started trained without a record (a note names them).
        """
        covered = [r for r in self.ranks_expected if r not in self.uncovered_ranks]
        if not covered:
            return f"inconclusive: {UNRECORDED_HINT if unrecorded else INCONCLUSIVE_HINT}"
        uncovered = ", ".join(map(str, self.uncovered_ranks))
        return (
            f"inconclusive: nothing that changes during training was compared on rank(s) {uncovered} "
            f"(training was compared on rank(s) {', '.join(map(str, covered))}); a rank that was not "
            "compared cannot pass"
        )

    def inconclusive_reason(self, *, unrecorded: bool = False) -> str:
        """The headline of an inconclusive verdict: what was not compared, in one line."""
        covered = [r for r in self.ranks_expected if r not in self.uncovered_ranks]
        if not covered and unrecorded:
            return (
                "nothing was compared: the training ran in python processes torchrepro does not "
                "record (see the notes)"
            )
        if not covered:
            return (
                "nothing that changes during training was compared: the script took no optimizer step, "
                "ran no backward(), read no DataLoader batch and recorded no value"
            )
        uncovered = ", ".join(map(str, self.uncovered_ranks))
        return (
            f"rank(s) {uncovered} were not compared: nothing that changes during training was recorded "
            f"there (training was compared on rank(s) {', '.join(map(str, covered))})"
        )

    def describe(self, *, uncovered: bool = True) -> str:
        """One line for people: what was compared, and (``uncovered``) what was not."""
        counts = self.per_kind
        parts = [f"{counts.get(kind, 0)} {kind}" for kind in ("init", "data", "compute", "record")]
        if counts.get(FINAL_KEY):
            parts.append(f"{counts['final']} final")
        text = "events compared: " + ", ".join(parts)
        if len(self.ranks_expected) > 1:
            text += f" over ranks {', '.join(map(str, self.ranks_expected))}"
        if uncovered and self.uncovered_ranks:
            text += "; nothing beyond init compared on rank(s) " + ", ".join(map(str, self.uncovered_ranks))
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"per_kind": {...}, "per_rank": {"0": {...}}, "uncovered_ranks": [...]}``."""
        return {
            "per_kind": self.per_kind,
            "per_rank": {str(r): dict(sorted(c.items())) for r, c in sorted(self.per_rank.items())},
            "uncovered_ranks": list(self.uncovered_ranks),
        }


def coverage(cursors: Sequence[RankCursor], ranks_expected: Sequence[int]) -> Coverage:
    """The coverage of a comparison: events compared per rank (summed over the compared run pairs)."""
    per_rank: dict[int, dict[str, int]] = {}
    for cursor in cursors:
        counts = per_rank.setdefault(cursor.rank, {})
        for kind, n in cursor.compared.items():
            counts[kind] = counts.get(kind, 0) + n
    return Coverage(per_rank=per_rank, ranks_expected=tuple(sorted(ranks_expected)))


INCONCLUSIVE_HINT = (
    "nothing that changes during training was compared: the script took no optimizer step, "
    "ran no backward(), read no DataLoader batch and recorded no value; call "
    "torchrepro.record(name, value) on what should be reproducible, e.g. the final weights"
)


UNRECORDED_HINT = (
    "nothing that changes during training was compared: the training ran in python processes "
    "the script started that torchrepro does not record (the notes name them); train in the "
    "process torchrepro starts, give each rank a process group or a RANK of its own, or call "
    "torchrepro.record(name, value) on what should be reproducible, e.g. the final weights"
)

FINAL_NOT_LOCATED = (
    "not located: the runs differ in no recorded training step, only in the state at exit, so "
    "there is no step to re-run with op tracing"
)
"""The note of a divergence seen only in the final state (locating traces a recorded step)."""


def inconclusive_verdict(
    covered: Coverage,
    world: WorldScope | None,
    unrecorded: bool,
    unrecorded_note: str | None = None,
) -> tuple[str, str] | None:
    """``(reason, note)`` when runs found equal cannot be called reproducible: not every rank
    compared enough (in the world view's terms across world sizes), or a process trained
    unrecorded (``unrecorded``, said by ``unrecorded_note``); None when they can. ``check`` and
    ``compare`` both decide it here."""
    if not covered.conclusive:
        if world is not None:
            reason = world.inconclusive_reason(covered)
            return reason, f"inconclusive: {reason}"
        return covered.inconclusive_reason(unrecorded=unrecorded), covered.inconclusive_note(
            unrecorded=unrecorded
        )
    if unrecorded:
        return UNRECORDED_REASON, unrecorded_note or f"inconclusive: {UNRECORDED_REASON}"
    return None


def final_state_reason(d: Divergence, covered: Coverage | None, *, unrecorded: bool) -> str:
    """The headline of a divergence seen only in the final state: which module, and why no recorded
    step shows it (``unrecorded``: processes the script started trained without a record)."""
    module = d.final_module() or "a module the script holds"
    steps = 0 if covered is None else covered.per_rank.get(d.rank, {}).get("compute", 0)
    if unrecorded:
        why = "it trained in python processes torchrepro does not record: see the notes"
    elif steps:
        why = (
            "every recorded training step matched: it changed after the last of them or beside them, "
            "through an update that no optimizer step or backward() made"
        )
    else:
        why = (
            "the process holding it took no optimizer step and ran no backward() torchrepro sees: "
            "e.g. gradients from torch.autograd.grad applied by hand, weights loaded or set outside "
            "training, or initial values drawn unseeded; torchrepro.record(name, value) where it "
            "changes finds the step"
        )
    return (
        f"the runs differ only in the final state of {module}: the training that changed it was not "
        f"recorded ({why})"
    )


def steps_compared(cursors: list[RankCursor]) -> int:
    """Optimizer steps compared: the highest compute step index reached on any rank, plus one."""
    return max((c.max_step_compared for c in cursors), default=-1) + 1


def optimizer_steps(cursors: Sequence[RankCursor]) -> dict[str, int]:
    """Optimizer steps compared per optimizer key, in optimizer order: the most any rank (and pair
    of runs) compared, so two optimizers stepping 20 times each are ``{"optimizer0": 20,
    "optimizer1": 20}``."""
    found: dict[str, int] = {}
    for cursor in cursors:
        for key, n in cursor.optimizer_steps.items():
            found[key] = max(found.get(key, 0), n)
    return {key: found[key] for key in sorted(found, key=optimizer_index)}


def compare_runs(run_a: str | os.PathLike[str], run_b: str | os.PathLike[str]) -> Comparison:
    """Compare two recorded runs (say, from two machines): first divergence and env differences."""
    a, b = load_run(run_a), load_run(run_b)
    sizes = (_world_size(a), _world_size(b))
    world = None if sizes[0] == sizes[1] else WorldScope(min(sizes), max(sizes))
    cursors: dict[int, RankCursor] = {}
    world_notes: list[str] = []
    if world is None:
        for rank in sorted(set(a.events) | set(b.events)):
            cursors[rank] = RankCursor(rank, a.events.get(rank, []), b.events.get(rank, []))
    else:  # rank 0 of the run on fewer processes against every rank of the other
        smaller, larger = (a, b) if sizes[0] < sizes[1] else (b, a)
        for rank in sorted(set(larger.events) | set(range(world.other))):  # a missing rank diverges
            pair = (smaller.events.get(0, []), larger.events.get(rank, []))
            cursors[rank] = world_cursor(rank, *(pair if smaller is a else pair[::-1]))
        world_notes.append(f"compared {world.describe()}")
        others = sorted(r for r in smaller.events if r != 0)
        if others:
            world_notes.append(
                f"rank(s) {', '.join(map(str, others))} of the run on {_processes(world.reference)} were "
                "not compared (its rank 0 stands for it)"
            )
    found = [d for d in (c.advance(a_done=True, b_done=True) for c in cursors.values()) if d is not None]
    first = earliest(found)
    tensor = None
    if first is not None:
        ea, eb = cursors[first.rank].a, cursors[first.rank].b
        if first.index < len(ea) and first.index < len(eb):
            tensor = tensor_difference(ea[first.index], eb[first.index])
    started = setting_differences(a, b)
    unrecorded = _unrecorded(a, b)
    env_differences, notes = environment_differences(a, b)
    notes = world_notes + unrecorded + notes
    covered = coverage(list(cursors.values()), sorted(cursors))
    reason = None
    if first is not None and world is not None:
        reason = world.divergence_reason(first)
        notes.append(WORLD_NOT_LOCATED)
    elif first is not None and first.final_state:
        reason = final_state_reason(first, covered, unrecorded=bool(unrecorded))
        notes.append(FINAL_NOT_LOCATED)
    elif first is not None and first.kind == "compute":
        first, locate_notes = _locate_recorded(first, a, b, varied=_varied_threads(started))
        notes += locate_notes
    reproducible: bool | None = first is None
    inconclusive = None if first is not None else inconclusive_verdict(covered, world, bool(unrecorded))
    if inconclusive is not None:
        reproducible = None
        reason, note = inconclusive
        notes.append(note)
    return Comparison(
        reproducible=reproducible,
        steps_compared=steps_compared(list(cursors.values())),
        first_divergence=first,
        coverage=covered,
        env_differences=env_differences,
        tensor=tensor,
        notes=tuple(d.describe() for d in started) + tuple(notes),
        setting_differences=started,
        optimizer_steps=optimizer_steps(list(cursors.values())),
        reason=reason,
        world=world,
    )


def _world_size(run: RunRecord) -> int:
    """The number of processes a record ran on: its ``--nproc``, else the largest process group its
    ranks noted joining, else 1 (never the events files found: a rank that wrote none is missing,
    not a smaller world)."""
    nproc = None if run.settings is None else run.settings.nproc
    return nproc or max(read_world(run.path).values(), default=1)


UNRECORDED_REASON = (
    "a python process the script started trained without a record, so its training was not compared"
)
"""The headline of a verdict with no divergence while a process the script started trained
unrecorded (its note names it)."""


def _unrecorded(a: RunRecord, b: RunRecord) -> list[str]:
    """The notes of python processes that trained without a record in either run, each once."""
    la, lb = read_uncovered(a.path), read_uncovered(b.path)
    notes = [f"in both runs: {line}" for line in la if line in lb]
    notes += [f"in run A: {line}" for line in la if line not in lb]
    notes += [f"in run B: {line}" for line in lb if line not in la]
    return notes


def environment_differences(a: RunRecord, b: RunRecord) -> tuple[list[Any], list[str]]:
    """The environment differences of two records, or none and a note saying why not.

    An environment that is missing, failed to collect or is malformed never hides the verdict.
    """
    if a.env is None or b.env is None:
        return [], []  # no environment recorded (an older or hand-made record)
    from torchrepro.env import Environment, diff_env  # imports torch: only when there is work

    envs = []
    for run in (a, b):
        where = os.path.join(run.path, ENV_FILE)
        assert run.env is not None
        if "error" in run.env:
            return [], [f"environments not compared: {where} says collecting it failed"]
        try:
            envs.append(Environment.from_dict(run.env))
        except EnvFileError as exc:
            return [], [f"environments not compared: {where} is malformed: {exc}"]
    return list(diff_env(envs[0], envs[1])), []


def _traced_optimizer(run: RunRecord) -> int:
    value = None if run.settings is None else run.settings.trace_optimizer
    return 0 if value is None else value


def _locate_recorded(
    first: Divergence, a: RunRecord, b: RunRecord, *, varied: str | None = None
) -> tuple[Divergence, list[str]]:
    """Fill op/module/location of a compute divergence from the runs' op traces of its step."""
    k = first.step
    hint = (
        f"record both runs with `torchrepro run --trace-step {k}` (or use `torchrepro check`) to name the op"
    )
    if not a.traces and not b.traces:
        return first, [f"no op traces recorded; {hint}"]
    for run in (a, b):
        if k not in run.traces:
            held = ", ".join(str(s) for s in sorted(run.traces)) or "none"
            return first, [f"{run.path} holds op traces of step(s) {held}, not of step {k}; {hint}"]
    if any(optimizer_index(first.key) != _traced_optimizer(run) for run in (a, b)):
        return first, [f"the op traces follow another optimizer than {first.key}; {hint}"]
    ranks = sorted(set(a.traces[k]) & set(b.traces[k]))
    if first.rank not in ranks:
        return first, [f"the op traces of step {k} do not cover rank {first.rank}; {hint}"]
    pairs = [(r, a.traces[k][r], b.traces[k][r]) for r in ranks]
    located, notes, failed = locate_in_traces(first, pairs, varied=varied)
    if located is not None:
        return located, notes
    if failed:
        compared = [r for r in ranks if r not in failed]
        matched = f"; those of rank(s) {', '.join(map(str, compared))} match" if compared else ""
        notes.append(
            f"the op traces of step {k} could not be compared on rank(s) {', '.join(map(str, failed))}"
            f"{matched}: the source op is unknown; {hint}"
        )
        return first, notes
    notes.append(
        f"the op traces of step {k} match on every rank: the difference entered outside the traced ops"
    )
    return first, notes


def locate_in_traces(
    first: Divergence,
    traces: Sequence[tuple[int, str | os.PathLike[str], str | os.PathLike[str]]],
    *,
    varied: str | None = None,
) -> tuple[Divergence | None, list[str], list[int]]:
    """Compare per-rank op traces ``(rank, trace_a, trace_b)`` of the step ``first`` diverged at.

    Returns ``first`` with ``op``, ``module``, ``location`` and ``rank`` of the source op filled
    (None when no pair of traces differs), notes on what went wrong or what the op did, and the
    ranks whose traces could not be compared (unreadable: never to be taken as matching).
    Among ranks, the source is an op that is not a collective, preferably on ``first.rank``.
    ``varied`` says how the two runs were started differently on purpose (``check --vary``, e.g.
    "with 1 thread in run 1 and 2 threads in run 2"): an op whose inputs are equal and whose output
    differs is then explained by that setting, not called nondeterministic.
    """
    from torchrepro.tracing import OpDivergence, compare_traces

    notes: list[str] = []
    failed: list[int] = []
    located: list[tuple[int, OpDivergence]] = []
    for r, ta, tb in traces:
        try:
            d = compare_traces(ta, tb)
        except Exception as exc:
            notes.append(f"comparing the op traces of rank {r} failed: {type(exc).__name__}: {exc}")
            failed.append(r)
            continue
        if d is not None:
            located.append((r, d))
    if not located:
        return None, notes, failed
    r, d = _pick_source(located, prefer_rank=first.rank)
    if varied is not None and d.inputs_equal:
        notes.append(
            f"source op {d.op}: every input is bitwise equal but its output differs {varied}: "
            "the op's result depends on that setting (e.g. a reduction split across threads), "
            "not on randomness"
        )
    elif d.note:
        notes.append(f"source op {d.op}: {d.note}")
    return replace(first, rank=r, op=d.op, module=d.module, location=d.location), notes, failed


def _pick_source(located: list[tuple[int, Any]], *, prefer_rank: int) -> tuple[int, Any]:
    """Among per-rank op divergences, the source: not a collective, else the preferred rank."""

    def is_collective(d: Any) -> bool:
        op = str(getattr(d, "op", "") or "")
        return "c10d" in op or "all_reduce" in op or "allreduce" in op

    non_collective = [(r, d) for r, d in located if not is_collective(d)]
    pool = non_collective or located
    for r, d in pool:
        if r == prefer_rank:
            return r, d
    return pool[0]
