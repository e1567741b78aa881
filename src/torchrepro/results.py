"""What a check or a comparison concluded: the result types, below everything that produces them.

Invariants: imports only the standard library and ``events``/``runrecord``'s names (no part that
computes a verdict), so ``errors``, ``verdict``, the command line, the report and the pytest plugin
name these types without reaching up into ``check`` or ``compare``. ``Outcome`` is the one place
where a result is read as reproducible, diverged, inconclusive or failed: exit codes, words and
colours map from it. Every ``to_dict`` is strict JSON (the ``--json`` contract).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from torchrepro.events import FINAL_KEY, counted_kind, describe_name

__all__ = [
    "WORLD_COMPARED",
    "WORLD_NOT_COMPARED",
    "CheckResult",
    "Comparison",
    "CompileScope",
    "Coverage",
    "Divergence",
    "Isolation",
    "Outcome",
    "Repro",
    "ResumePoint",
    "ResumeScope",
    "SettingDifference",
    "StepGap",
    "TensorDifference",
    "WorldScope",
    "processes",
]


class Outcome(enum.Enum):
    """What a check or comparison concluded, decided once (``Outcome.of``)."""

    REPRODUCIBLE = "reproducible"
    DIVERGED = "not reproducible"
    INCONCLUSIVE = "inconclusive"
    """No divergence, but not enough was compared to call the runs reproducible."""
    FAILED = "failed"
    """A run failed (the script's error, not a divergence)."""

    @classmethod
    def of(cls, reproducible: bool | None, *, failed: bool = False) -> Outcome:
        """The outcome of a verdict's ``reproducible`` (None: inconclusive) and whether a run failed."""
        if failed:
            return cls.FAILED
        if reproducible is None:
            return cls.INCONCLUSIVE
        return cls.REPRODUCIBLE if reproducible else cls.DIVERGED

    @property
    def exit_code(self) -> int:
        """The command line's exit code: 0 reproducible, 1 not, 2 a run failed, 3 inconclusive."""
        return {"reproducible": 0, "not reproducible": 1, "failed": 2, "inconclusive": 3}[self.value]

    @property
    def passed(self) -> bool:
        """Whether a test asserting reproducibility passes: only a conclusive "reproducible"."""
        return self is Outcome.REPRODUCIBLE

    def words(self, *, runs: str = "reproducible") -> str:
        """The status in words; ``runs="identical"`` for a comparison of two records."""
        return self.value.replace("reproducible", runs)


def processes(n: int) -> str:
    """``1 process``, ``2 processes``."""
    return f"{n} process{'es' if n != 1 else ''}"


NODE_LOST = "stopped answering"
"""In a check across nodes: the words of an error that names a lost node (``check_nodes``)."""
LOST_LEADER = "this node lost the check"
LEADER_ENDED = "the check on node 0 ended"
"""How a follower's error starts when the check, not the script, ended it (``check_nodes``)."""


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
        return f"{self.reference} vs {processes(self.other)}"

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
            f"across world sizes: rank 0 of the run on {processes(self.reference)} against every rank "
            f"of the run on {processes(self.other)}; compared: {compared}; not compared: {left_out}"
        )


@dataclass(frozen=True)
class ResumePoint:
    """One kill and restart of ``check --vary resume``: the run was killed after ``killed_after``
    optimizer steps; the restarted run started from the state of the first run after
    ``restored_at`` steps (None: it could not be aligned) and ``steps_compared`` of its steps were
    compared with the first run's (the one that differs included)."""

    killed_after: int
    restored_at: int | None
    steps_compared: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "killed_after": self.killed_after,
            "restored_at": self.restored_at,
            "steps_compared": self.steps_compared,
        }

    def describe(self) -> str:
        """``killed after step 5, restored at step 5, 7 steps compared``."""
        restored = "not aligned" if self.restored_at is None else f"restored at step {self.restored_at}"
        steps = f"{self.steps_compared} step{'s' if self.steps_compared != 1 else ''} compared"
        return f"killed after step {self.killed_after}, {restored}, {steps}"


@dataclass(frozen=True)
class ResumeScope:
    """What ``check --vary resume`` did: one ``ResumePoint`` per kill, in the order of their steps;
    ``reported`` indexes the point the verdict is about (the first that differs or could not be
    aligned; else the first)."""

    points: tuple[ResumePoint, ...]
    reported: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The ``resume`` object of ``check --json``: the reported point's fields, and every point."""
        return {**self.points[self.reported].to_dict(), "points": [p.to_dict() for p in self.points]}

    def describe(self) -> str:
        """Every point in words, ``; `` between them."""
        return "; ".join(p.describe() for p in self.points)


@dataclass(frozen=True)
class StepGap:
    """How far the compiled run is from eager at one step (``check --vary compile``): the largest
    ``|a-b|`` among the recorded values of its differing tensors (None: none differs, or
    ``nonfinite``), a lower bound unless ``exact`` (every value of each differing tensor recorded)."""

    step: int
    differing: int
    tensors: int
    largest: float | None
    exact: bool = True
    nonfinite: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "differing": self.differing,
            "tensors": self.tensors,
            "largest": self.largest,
            "exact": self.exact,
            "nonfinite": self.nonfinite,
        }


@dataclass(frozen=True)
class CompileScope:
    """What ``check --vary compile`` compared: run 1 eager (``torch.compile`` off), the later runs
    compiled as the script compiles. ``compiles``: the compilations Dynamo finished in the compiled
    run (0: it compiled nothing, and nothing was varied); ``fallback_random``: Inductor's switch in
    the compiled run (strict mode sets it: compiled random ops draw as eager's do); ``cache``:
    Inductor's cache directory the compiled run started with (the check's own, empty);
    ``steps``: the distance per compared step, up to the end of the compared steps; ``graph``: the
    compiled graph and node where the compiled forward first differs from eager, in words
    (``tracing.compiled``), when it was located."""

    compiles: int
    fallback_random: bool
    cache: str | None
    steps: tuple[StepGap, ...] = ()
    graph: str | None = None

    @property
    def largest(self) -> float | None:
        """The largest difference over every compared step (None: no recorded value differs)."""
        values = [g.largest for g in self.steps if g.largest is not None]
        return max(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        """The ``compile`` object of ``check --json``."""
        return {
            "eager_run": 1,
            "compiles": self.compiles,
            "fallback_random": self.fallback_random,
            "cache": self.cache,
            "largest": self.largest,
            "steps": [g.to_dict() for g in self.steps],
            "graph": self.graph,
        }

    def describe(self) -> str:
        """What was compiled and how far apart it went, in one line."""
        random = "on (compiled random ops draw as eager's)" if self.fallback_random else "off"
        gaps = [g for g in self.steps if g.differing]
        if not gaps:
            far = f"every recorded value equal over {len(self.steps)} step(s)"
        else:
            shown = ", ".join(f"{g.step}: {_gap(g)}" for g in gaps[:6])
            more = f", ... ({len(gaps)} steps differ)" if len(gaps) > 6 else ""
            far = f"largest difference per step: {shown}{more}"
        return (
            f"compile: run 1 eager, the compiled run finished {self.compiles} compilation(s) "
            f"(Inductor cache: the check's own, cold); fallback_random {random}; {far}"
        )


def _gap(g: StepGap) -> str:
    if g.nonfinite:
        return "non-finite"
    if g.largest is None:
        return "?"
    return f"{g.largest:.3g}" + ("" if g.exact else "+")


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


@dataclass(frozen=True)
class Isolation:
    """How a check's runs were kept apart: ``mode`` ``"overlay"`` (each run saw the working
    directory ``root`` as the check found it plus its own writes, kept in its record's
    ``FILES_DIR``) or ``"none"`` (``reason`` says why); ``user_namespace``: the overlay was mounted
    in a user namespace (not root)."""

    mode: str
    root: str
    reason: str | None = None
    user_namespace: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The verdict's ``isolation`` object."""
        return {
            "mode": self.mode,
            "root": self.root,
            "user_namespace": self.user_namespace,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Repro:
    """What ``check --repro`` wrote: ``script`` and ``inputs`` in ``directory``, calling ``op`` once
    per entry of ``calls`` (a thread count); ``reproduces`` says whether the script, run once in a
    fresh process by the check, showed the difference (None: it did not finish)."""

    directory: str
    script: str
    inputs: str
    op: str
    calls: tuple[int, ...]
    reproduces: bool | None
    output: str = ""
    """What the script printed when the check ran it (the op's outputs compared call by call)."""

    def to_dict(self) -> dict[str, Any]:
        """The ``repro`` object of the ``check --json`` verdict."""
        d = asdict(self)
        d["calls"] = list(self.calls)
        return d


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
    environment: tuple[dict[str, Any], ...] = ()
    """``env_differences`` as ``compare --json`` lists them: each also says whether it exists
    between any two records (``volatile``) and which setting difference set it (``setting``)."""

    @property
    def outcome(self) -> Outcome:
        """What the comparison concluded (a comparison never fails: its records were read)."""
        return Outcome.of(self.reproducible)

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
            "inconclusive": self.outcome is Outcome.INCONCLUSIVE,
            "reason": self.reason,
            "coverage": None if self.coverage is None else self.coverage.to_dict(),
            "env_differences": [dict(d) for d in self.environment],
            "tensor": None if self.tensor is None else self.tensor.to_dict(),
            "notes": list(self.notes),
        }
        if self.world is not None:  # runs on different numbers of processes
            d["world"] = self.world.to_dict()
        return d


@dataclass(frozen=True)
class CheckResult:
    """The verdict of a check.

    ``reproducible`` is None when a run failed (``error`` says how, ``stderr_tail`` shows the
    end of its output) or when the check is inconclusive (no divergence, but nothing beyond
    ``init`` compared on some rank: ``coverage`` says what was); ``notes`` say what locating did
    or could not do, and why a check is inconclusive. ``isolation`` says how the runs' writes
    were kept apart; ``shared_writes`` are the paths runs running together both wrote anyway.
    ``reason`` is the headline's why: the specific reason of an inconclusive check, or, for runs
    that differ only in the final state, that the training which changed it was not recorded.
    ``varied`` is what ``--vary`` (and ``later_args``) changed, in words (``1 vs 2 threads``).
    ``optimizer_steps`` counts the optimizer steps compared per optimizer (``steps_compared``
    counts training steps).
    ``portable`` is what portable mode set in the runs (``MKL_CBWR``, ``ATEN_CPU_CAPABILITY``,
    ``onednn``: False), None when it was off.
    ``world`` (``--vary world``) says which ranks and events were compared across world sizes;
    ``reason`` then says, for a divergence, why the runs part and what to do.
    ``repro`` is what ``repro=DIR`` wrote (None: nothing; the notes say why).
    ``resume`` (``--vary resume``) says where the run was killed and where its restart was aligned.
    ``compile`` (``--vary compile``) says what was compiled and how far from eager each step went.
    """

    reproducible: bool | None
    runs: int
    steps_compared: int
    first_divergence: Divergence | None
    check_dir: str
    error: str | None = None
    returncode: int | None = None
    stderr_tail: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    coverage: Coverage | None = None
    isolation: Isolation | None = None
    shared_writes: tuple[str, ...] = ()
    reason: str | None = None
    varied: str | None = None
    optimizer_steps: dict[str, int] = field(default_factory=dict)
    portable: dict[str, Any] | None = None
    world: WorldScope | None = None
    repro: Repro | None = None
    resume: ResumeScope | None = None
    compile: CompileScope | None = None
    leader: str | None = None
    """Across nodes, on a node that did not lead: the leader (``node 0 (host h)``), whose machine
    ``check_dir`` is on (None: this machine)."""

    @property
    def outcome(self) -> Outcome:
        """What the check concluded: ``FAILED`` when a run failed, else from ``reproducible``."""
        return Outcome.of(self.reproducible, failed=self.error is not None)

    @property
    def node_failed(self) -> bool:
        """Across nodes: the check failed because a node, or the leading check, was lost (not the
        script)."""
        error = self.error or ""
        return NODE_LOST in error or error.startswith((LOST_LEADER, LEADER_ENDED))

    @property
    def inconclusive(self) -> bool:
        """No divergence, but not enough was compared to call the script reproducible."""
        return self.outcome is Outcome.INCONCLUSIVE

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, check_dir: str | None = None) -> CheckResult:
        """A verdict read back from ``to_dict``'s object (what a check across nodes sends its other
        nodes, ``check_nodes``): the outcome, the first divergence, coverage, notes and isolation;
        ``check_dir`` in place of the one it names."""
        first = d.get("first_divergence")
        divergence = None
        if first is not None:
            shape = first.get("shape")
            divergence = Divergence(
                **{
                    k: first.get(k)
                    for k in ("step", "rank", "kind", "op", "module", "location", "key", "name")
                },
                shape=None if shape is None else tuple(shape),
                dtype=first.get("dtype"),
            )
        covered = d.get("coverage")
        coverage = None
        if covered is not None:
            per_rank = {int(r): dict(c) for r, c in covered.get("per_rank", {}).items()}
            expected = sorted({*per_rank, *map(int, covered.get("uncovered_ranks", []))})
            coverage = Coverage(per_rank=per_rank, ranks_expected=tuple(expected))
        isolation = d.get("isolation")
        return cls(
            reproducible=d.get("reproducible"),
            runs=int(d.get("runs", 0)),
            steps_compared=int(d.get("steps_compared", 0)),
            first_divergence=divergence,
            check_dir=str(d.get("check_dir", "")) if check_dir is None else check_dir,
            error=d.get("error"),
            notes=tuple(d.get("notes", ())),
            coverage=coverage,
            isolation=None if isolation is None else Isolation(**isolation),
            shared_writes=tuple(d.get("shared_writes", ())),
            reason=d.get("reason"),
            varied=d.get("varied"),
            optimizer_steps=dict(d.get("steps_per_optimizer", {})),
            portable=d.get("portable"),
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``check --json`` object and ``verdict.json`` (``error`` only when a run failed,
        ``world`` only with ``--vary world``)."""
        d: dict[str, Any] = {
            "reproducible": self.reproducible,
            "runs": self.runs,
            "steps_compared": self.steps_compared,
            "optimizer_steps": sum(self.optimizer_steps.values()),
            "steps_per_optimizer": dict(self.optimizer_steps),
            "first_divergence": None if self.first_divergence is None else self.first_divergence.to_dict(),
            "inconclusive": self.inconclusive,
            "reason": self.reason,
            "varied": self.varied,
            "portable": None if self.portable is None else dict(self.portable),
            "coverage": None if self.coverage is None else self.coverage.to_dict(),
            "notes": list(self.notes),
            "repro": None if self.repro is None else self.repro.to_dict(),
        }
        if self.world is not None:
            d["world"] = self.world.to_dict()
        if self.resume is not None:
            d["resume"] = self.resume.to_dict()
        if self.compile is not None:
            d["compile"] = self.compile.to_dict()
        if self.isolation is not None:
            d["isolation"] = self.isolation.to_dict()
            d["shared_writes"] = list(self.shared_writes)
        if self.error is not None:
            d["error"] = self.error
        return d
