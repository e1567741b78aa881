"""Verdicts in words: the lines ``check`` and ``compare`` show a person, and the reasons and notes
of a verdict (why it is inconclusive, why runs on different numbers of processes part, what was
not located), each sentence written once.

Invariants: no torch, and nothing that computes a verdict: the standard library, ``events``,
``results`` and ``runrecord``'s names (the command line imports this module at start, and
``torchrepro.testing`` builds its assertion messages from the same lines, so a test failure reads
exactly like ``torchrepro check``); nothing here prints.
"""

from __future__ import annotations

from typing import Any, Final

from torchrepro.events import BACKWARD_KEY, describe_name, is_step
from torchrepro.portable import CBWR_VAR, CPU_CAPABILITY_VAR
from torchrepro.protocol import OMP_THREADS_VAR
from torchrepro.results import (
    CheckResult,
    Comparison,
    Coverage,
    Divergence,
    Isolation,
    Outcome,
    SettingDifference,
    WorldScope,
    processes,
)
from torchrepro.runrecord import FILES_DIR

__all__ = [
    "FINAL_NOT_LOCATED",
    "INCONCLUSIVE_HINT",
    "NOTHING_COMPARED",
    "UNRECORDED_HINT",
    "UNRECORDED_REASON",
    "WORLD_FIX",
    "WORLD_NOT_LOCATED",
    "coverage_inconclusive_note",
    "coverage_inconclusive_reason",
    "describe_check",
    "describe_comparison",
    "describe_divergence",
    "describe_final_state",
    "describe_isolation",
    "describe_portable",
    "describe_setting",
    "describe_steps",
    "final_state_reason",
    "inconclusive_verdict",
    "world_divergence_reason",
    "world_inconclusive_reason",
]


def describe_divergence(divergence: Divergence) -> str:
    """Where two runs first part, in one line: the kind, the step, what differs, the op and line."""
    d = divergence
    step = f"batch {d.step}" if d.kind == "data" else f"step {d.step}"
    where = f"{d.kind} at {step}" + (f", rank {d.rank}" if d.rank else "")
    of = {"data": f"of {d.key}", "record": f"of record {d.key!r}"}.get(d.kind, f"of {d.key}")
    if d.key == BACKWARD_KEY:
        where += " (parameters at the first backward())" if d.kind == "init" else " (a backward() step)"
    elif d.key and not is_step(d.kind, d.key):
        where += f" ({of})" if d.kind != "init" else f" (parameters given to {d.key})"
    extra = []
    what = d.what()
    if what:
        extra.append(f"first differing: {what}")
    if d.kind == "data" and d.location:
        extra.append(f"loader created at {d.location}")
    elif d.op:
        extra += [f"{k} {v}" for k, v in (("op", d.op), ("module", d.module), ("location", d.location)) if v]
    return where + ("; " + ", ".join(extra) if extra else "")


def describe_steps(steps: int, per_optimizer: dict[str, int]) -> str:
    """Training steps as the user counts them: ``20 training steps (40 optimizer steps: 2
    optimizers x 20)`` when several optimizers stepped."""
    text = f"{steps} training step{'s' if steps != 1 else ''}"
    counts = list(per_optimizer.values())
    if len(counts) > 1:
        split = (
            f"{len(counts)} optimizers x {counts[0]}"
            if len(set(counts)) == 1
            else f"{' + '.join(map(str, counts))} of {len(counts)} optimizers"
        )
        text += f" ({sum(counts)} optimizer steps: {split})"
    return text


def describe_final_state(divergence: Divergence) -> str:
    """The differing tensor of a divergence seen only in the final state."""
    what = divergence.what()
    where = f" (rank {divergence.rank})" if divergence.rank else ""
    return f"first differing: {what}{where}" if what else f"the final state{where}"


def describe_isolation(isolation: Isolation) -> str:
    """How a check's runs were kept apart, in one line."""
    if isolation.mode == "overlay":
        how = "a user namespace" if isolation.user_namespace else "a private mount namespace"
        return (
            f"each run wrote to its own copy-on-write overlay of {isolation.root} ({how}); "
            f"their files are in run<i>/{FILES_DIR}/"
        )
    return f"the runs shared {isolation.root}: {isolation.reason}"


_UNSET = {
    "threads": "not pinned",
    OMP_THREADS_VAR: "unset",
    "vary": "none",
    "portable": "off",
    CBWR_VAR: "unset",
    CPU_CAPABILITY_VAR: "unset",
}
"""How a setting that was not given reads (``None`` among a record's settings)."""


def describe_setting(d: SettingDifference) -> str:
    """One way two runs were started differently, in words (with what it means, when known)."""
    a, b = (
        _UNSET.get(d.name, "not set") if v in (None, False) else "on" if v is True else repr(v)
        for v in (d.a, d.b)
    )
    detail = f" ({d.detail})" if d.detail else ""
    return f"started with different {d.name}: {a} vs {b}{detail}"


def describe_portable(values: dict[str, Any]) -> str:
    """``MKL_CBWR=AVX2,STRICT, ATEN_CPU_CAPABILITY=avx2, oneDNN off`` (an unset variable: left out)."""
    shown = [f"{k}={v}" for k, v in values.items() if k != "onednn" and v is not None]
    return ", ".join([*shown, "oneDNN off"])


def describe_check(result: CheckResult) -> list[str]:
    """The verdict of a check that ran to a verdict (``result.error`` is None), as ``torchrepro
    check`` prints it: the headline, what was compared, what portable mode set, and how the runs
    were isolated."""
    if result.outcome is Outcome.FAILED:
        raise ValueError("describe_check describes a verdict; this check failed to run (see .error)")
    steps = describe_steps(result.steps_compared, result.optimizer_steps)
    varied = f"; varied: {result.varied}" if result.varied else ""
    with_varied = f" with {result.varied}" if result.varied else ""
    if result.resume is not None and result.outcome is Outcome.REPRODUCIBLE:
        lines = [f"resumes exactly: {result.resume.describe()}", f"  ({steps} compared; {result.varied})"]
    elif result.resume is not None and result.outcome is Outcome.DIVERGED and result.first_divergence:
        lines = [
            "NOT reproducible across a resume: first divergence: "
            + describe_divergence(result.first_divergence),
            f"  {result.reason}" if result.reason else "",
            f"  resume: {result.resume.describe()}",
        ]
        lines = [line for line in lines if line]
    else:
        lines = _headline(
            result.outcome,
            result.reason,
            result.first_divergence,
            negative="NOT reproducible",
            compared=f"{steps} compared{varied}",
            who=f"{result.runs} runs",
            identical=f"reproducible: {result.runs} runs identical over {steps}{with_varied}",
            compared_after=True,
        )
        if result.resume is not None:
            lines.append(f"  resume: {result.resume.describe()}")
    if result.coverage is not None:
        lines.append(f"  {result.coverage.describe(uncovered=result.outcome is not Outcome.DIVERGED)}")
    if result.portable is not None:
        lines.append(f"  portable: {describe_portable(result.portable)}")
    if result.world is not None:
        lines.append(f"  {result.world.describe()}")
    if result.compile is not None:
        if result.compile.graph is not None:
            lines.append(f"  located in a compiled graph: {result.compile.graph}")
        lines.append(f"  {result.compile.describe()}")
    if result.isolation is not None:
        lines.append(f"  isolation: {describe_isolation(result.isolation)}")
    return lines


def describe_comparison(result: Comparison) -> list[str]:
    """The verdict of ``compare`` as ``torchrepro compare`` prints it: the headline, the notes, the
    first differing tensor and, last when there is one, what was compared (the command line prints
    the environment differences before that last line)."""
    steps = describe_steps(result.steps_compared, result.optimizer_steps)
    lines = _headline(
        result.outcome,
        result.reason,
        result.first_divergence,
        negative="NOT identical",
        compared=f"{steps} compared",
        who="the runs",
        identical=f"identical: {steps} compared",
    )
    d = result.first_divergence
    lines.extend(f"  {note}" for note in result.notes)
    if result.outcome is not Outcome.REPRODUCIBLE and result.tensor is not None:
        t = result.tensor
        diff = t.describe_difference()
        label = describe_name(t.name, d.kind if d is not None else "") if t.name else f"#{t.leaf}"
        lines.append(f"  first differing tensor: {label} {t.dtype}{t.shape}, largest |a-b|: {diff}")
    if result.coverage is not None:
        lines.append(f"  {result.coverage.describe(uncovered=result.outcome is not Outcome.DIVERGED)}")
    return lines


def _headline(
    outcome: Outcome,
    reason: str | None,
    d: Divergence | None,
    *,
    negative: str,
    compared: str,
    who: str,
    identical: str,
    compared_after: bool = False,
) -> list[str]:
    """The first lines of a verdict (``check``'s and ``compare``'s differ only in their words):
    inconclusive with its reason, ``identical``, a difference only in the
    state at exit, or the first divergence (and, across world sizes, why the runs part; with
    ``compared_after``, then what was compared)."""
    if outcome is Outcome.INCONCLUSIVE:
        return [
            f"INCONCLUSIVE: {reason or 'not enough was compared to say so'}",
            f"  ({who} did not differ; {compared})",
        ]
    if outcome is Outcome.REPRODUCIBLE:
        return [identical]
    assert d is not None
    if d.final_state and reason:
        return [f"{negative}: {reason}", f"  {describe_final_state(d)} ({compared})"]
    lines = [f"{negative}: first divergence: {describe_divergence(d)}"]
    if reason:  # across world sizes: why the runs part, and the fix
        lines.append(f"  {reason}")
    if compared_after:
        lines.append(f"  ({compared})")
    return lines


NOTHING_COMPARED: Final = (
    "nothing that changes during training was compared: the script took no optimizer step, "
    "ran no backward(), read no DataLoader batch and recorded no value"
)
"""Why nothing could be called reproducible, when a script trains in no way torchrepro sees."""

INCONCLUSIVE_HINT: Final = (
    f"{NOTHING_COMPARED}; call torchrepro.record(name, value) on what should be reproducible, e.g. the "
    "final weights"
)

UNRECORDED_HINT = (
    "nothing that changes during training was compared: the training ran in python processes "
    "the script started that torchrepro does not record (the notes name them); train in the "
    "process torchrepro starts, give each rank a process group or a RANK of its own, or call "
    "torchrepro.record(name, value) on what should be reproducible, e.g. the final weights"
)

UNRECORDED_REASON = (
    "a python process the script started trained without a record, so its training was not compared"
)
"""The headline of a verdict with no divergence while a process the script started trained
unrecorded (its note names it)."""

FINAL_NOT_LOCATED = (
    "not located: the runs differ in no recorded training step, only in the state at exit, so "
    "there is no step to re-run with op tracing"
)
"""The note of a divergence seen only in the final state (locating traces a recorded step)."""

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


def coverage_inconclusive_note(coverage: Coverage, *, unrecorded: bool = False) -> str:
    """Why an "identical" verdict cannot be claimed (for a coverage that is not conclusive).

    ``unrecorded``: processes the script started trained without a record (a note names them).
    """
    covered = [r for r in coverage.ranks_expected if r not in coverage.uncovered_ranks]
    if not covered:
        return f"inconclusive: {UNRECORDED_HINT if unrecorded else INCONCLUSIVE_HINT}"
    uncovered = ", ".join(map(str, coverage.uncovered_ranks))
    return (
        f"inconclusive: nothing that changes during training was compared on rank(s) {uncovered} "
        f"(training was compared on rank(s) {', '.join(map(str, covered))}); a rank that was not "
        "compared cannot pass"
    )


def coverage_inconclusive_reason(coverage: Coverage, *, unrecorded: bool = False) -> str:
    """The headline of an inconclusive verdict: what was not compared, in one line."""
    covered = [r for r in coverage.ranks_expected if r not in coverage.uncovered_ranks]
    if not covered and unrecorded:
        return (
            "nothing was compared: the training ran in python processes torchrepro does not "
            "record (see the notes)"
        )
    if not covered:
        return NOTHING_COMPARED
    uncovered = ", ".join(map(str, coverage.uncovered_ranks))
    return (
        f"rank(s) {uncovered} were not compared: nothing that changes during training was recorded "
        f"there (training was compared on rank(s) {', '.join(map(str, covered))})"
    )


def world_divergence_reason(world: WorldScope, d: Divergence) -> str:
    """Why runs on ``world``'s numbers of processes part at ``d``, in words, with the fix."""
    between = f"between {world.reference} and {processes(world.other)}"
    on = f" (rank {d.rank} of the run on {processes(world.other)})"
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


def world_inconclusive_reason(world: WorldScope, covered: Coverage) -> str:
    """The headline of a comparison across world sizes in which no optimizer step was compared
    on some rank (``covered`` is not conclusive)."""
    what = (
        f"rank(s) {', '.join(map(str, covered.uncovered_ranks))} of the run on {processes(world.other)}"
        if len(covered.uncovered_ranks) < len(covered.ranks_expected)
        else "any rank"
    )
    return (
        f"no optimizer step was compared on {what}: across world sizes only the parameters given "
        "to an optimizer, each optimizer step and the state at exit are compared (batches, "
        "recorded values and backward() steps depend on the split), and the script took no "
        "optimizer step torchrepro records"
    )


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
            reason = world_inconclusive_reason(world, covered)
            return reason, f"inconclusive: {reason}"
        return coverage_inconclusive_reason(covered, unrecorded=unrecorded), coverage_inconclusive_note(
            covered, unrecorded=unrecorded
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
