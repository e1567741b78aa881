"""Verdicts in words: the lines ``check`` and ``compare`` show a person, written once.

Invariants: standard library only (the command line imports this module at start, and
``torchrepro.testing`` builds its assertion messages from the same lines, so a test failure reads
exactly like ``torchrepro check``); nothing here prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrepro.events import BACKWARD_KEY, describe_name, is_step

if TYPE_CHECKING:
    from torchrepro.check import CheckResult
    from torchrepro.compare import Comparison, Divergence

__all__ = [
    "describe_check",
    "describe_comparison",
    "describe_divergence",
    "describe_final_state",
    "describe_portable",
    "describe_steps",
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


def describe_portable(values: dict[str, Any]) -> str:
    """``MKL_CBWR=AVX2,STRICT, ATEN_CPU_CAPABILITY=avx2, oneDNN off`` (an unset variable: left out)."""
    shown = [f"{k}={v}" for k, v in values.items() if k != "onednn" and v is not None]
    return ", ".join([*shown, "oneDNN off"])


def describe_check(result: CheckResult) -> list[str]:
    """The verdict of a check that ran to a verdict (``result.error`` is None), as ``torchrepro
    check`` prints it: the headline, what was compared, what portable mode set, and how the runs
    were isolated."""
    if result.error is not None:
        raise ValueError("describe_check describes a verdict; this check failed to run (see .error)")
    steps = describe_steps(result.steps_compared, result.optimizer_steps)
    varied = f"; varied: {result.varied}" if result.varied else ""
    with_varied = f" with {result.varied}" if result.varied else ""
    lines = _headline(
        None if result.inconclusive else result.reproducible,
        result.reason,
        result.first_divergence,
        negative="NOT reproducible",
        compared=f"{steps} compared{varied}",
        who=f"{result.runs} runs",
        identical=f"reproducible: {result.runs} runs identical over {steps}{with_varied}",
        compared_after=True,
    )
    if result.coverage is not None:
        lines.append(f"  {result.coverage.describe(uncovered=result.reproducible is not False)}")
    if result.portable is not None:
        lines.append(f"  portable: {describe_portable(result.portable)}")
    if result.world is not None:
        lines.append(f"  {result.world.describe()}")
    if result.isolation is not None:
        lines.append(f"  isolation: {result.isolation.describe()}")
    return lines


def describe_comparison(result: Comparison) -> list[str]:
    """The verdict of ``compare`` as ``torchrepro compare`` prints it: the headline, the notes, the
    first differing tensor and, last when there is one, what was compared (the command line prints
    the environment differences before that last line)."""
    steps = describe_steps(result.steps_compared, result.optimizer_steps)
    lines = _headline(
        result.reproducible,
        result.reason,
        result.first_divergence,
        negative="NOT identical",
        compared=f"{steps} compared",
        who="the runs",
        identical=f"identical: {steps} compared",
    )
    d = result.first_divergence
    lines.extend(f"  {note}" for note in result.notes)
    if not result.reproducible and result.tensor is not None:
        t = result.tensor
        diff = t.describe_difference()
        label = describe_name(t.name, d.kind if d is not None else "") if t.name else f"#{t.leaf}"
        lines.append(f"  first differing tensor: {label} {t.dtype}{t.shape}, largest |a-b|: {diff}")
    if result.coverage is not None:
        lines.append(f"  {result.coverage.describe(uncovered=result.reproducible is not False)}")
    return lines


def _headline(
    reproducible: bool | None,
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
    inconclusive (``reproducible`` None) with its reason, ``identical``, a difference only in the
    state at exit, or the first divergence (and, across world sizes, why the runs part; with
    ``compared_after``, then what was compared)."""
    if reproducible is None:
        return [
            f"INCONCLUSIVE: {reason or 'not enough was compared to say so'}",
            f"  ({who} did not differ; {compared})",
        ]
    if reproducible:
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
