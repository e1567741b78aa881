"""The settings rules: findings for the switches, seeding and compilation a script ran with.

Invariants:
- ``audit_settings`` is a pure function of the probe's ``ProbeSettings`` and the recorded ops:
  testable without running anything. Each finding code has one small rule (``_RULES``, in the
  order the codes were checked); a rule returns the findings of its code, usually none or one.
- The recorded ops decide which settings matter (``_Run``): the CUBLAS variable only when cuBLAS
  ops ran, deterministic mode only when ops that need it ran, cuDNN's TF32 only when the script
  convolves.
- Loader and seed records are judged by ``audit.loader_rules``; findings are one per code and
  location (a rule's records of one line, from a loop or from each process, are one cause:
  ``findings.collapse``), sorted by ``findings.sort_key``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torchrepro.audit.findings import Finding, collapse, settings_finding, sort_key
from torchrepro.audit.loader_rules import dataloader_findings, tainted_seed_finding
from torchrepro.audit.op_rules import as_event, audit_ops
from torchrepro.audit.optable import load_table
from torchrepro.audit.settings import ProbeSettings
from torchrepro.flags import CUBLAS_CONFIGS

__all__ = ["audit_settings", "describe_processes", "processes", "steps_of"]

_STRICT = "torchrepro run, or torch.use_deterministic_algorithms(True)"


@dataclasses.dataclass(frozen=True)
class _Run:
    """The settings, and what the recorded ops say about which of them matter."""

    settings: ProbeSettings
    needs_strict: list[str]  # ops strict mode makes deterministic (not cuDNN's when it is deterministic)
    cannot: list[str]  # ops with no deterministic implementation (or that may have none)
    uses_cublas: bool
    uses_conv: bool


def _run(settings: ProbeSettings, events: Iterable[Any]) -> _Run:
    table = load_table()
    evs = [as_event(e) for e in events]
    op_findings = audit_ops(evs, calls=settings.calls)
    needs_strict = sorted({f.op or "" for f in op_findings if f.severity == "info"})
    if settings.cudnn_deterministic:
        conv = {s.name for e in table.entries if e.code == "TR120" for s in e.ops}
        needs_strict = [o for o in needs_strict if o.rsplit(".", 1)[0] not in conv and o not in conv]
    return _Run(
        settings=settings,
        needs_strict=needs_strict,
        cannot=sorted({f.op or "" for f in op_findings if f.severity in ("error", "warning")}),
        uses_cublas=any(e.name in table.cublas_ops for e in evs),
        uses_conv=any(e.name in ("aten.convolution", "aten._convolution") for e in evs),
    )


def _hash_randomization(run: _Run) -> list[Finding]:
    """TR201: PYTHONHASHSEED was unset when Python started."""
    if not run.settings.hash_randomization:
        return []
    return [
        settings_finding(
            "TR201",
            "warning",
            "Hash randomisation is on (PYTHONHASHSEED unset when Python started): the iteration order "
            "of sets of str/bytes changes every run. It is read once at interpreter start, so setting "
            "os.environ inside the script changes nothing for that process.",
            "Start the script with PYTHONHASHSEED=0 (torchrepro run does), or call "
            "torchrepro.relaunch() at the top of the script.",
        )
    ]


def _cublas_workspace(run: _Run) -> list[Finding]:
    """TR202: cuBLAS ops ran without a deterministic ``CUBLAS_WORKSPACE_CONFIG`` (strict mode: an error)."""
    cublas = run.settings.cublas_workspace_config
    if cublas in CUBLAS_CONFIGS or not run.uses_cublas:
        return []
    strict = bool(run.settings.deterministic_algorithms) and not run.settings.warn_only
    return [
        settings_finding(
            "TR202",
            "error" if strict else "warning",
            f"CUBLAS_WORKSPACE_CONFIG is {'unset' if cublas is None else repr(cublas)} and the script "
            "runs cuBLAS matmuls: "
            + (
                "with the deterministic algorithms it turns on, every matmul raises RuntimeError on CUDA."
                if strict
                else "on CUDA, cuBLAS may then pick nondeterministic reductions."
            ),
            f"Set CUBLAS_WORKSPACE_CONFIG={CUBLAS_CONFIGS[0]} (or {CUBLAS_CONFIGS[1]}) in the "
            "environment before CUDA starts (torchrepro run does).",
        )
    ]


def _cudnn_benchmark(run: _Run) -> list[Finding]:
    """TR203: cuDNN benchmarking is on."""
    if not run.settings.cudnn_benchmark:
        return []
    return [
        settings_finding(
            "TR203",
            "warning",
            "torch.backends.cudnn.benchmark is on: cuDNN times candidate algorithms and may pick a "
            "different one each run.",
            "Set torch.backends.cudnn.benchmark = False (strict mode does).",
        )
    ]


def _reduced_precision(run: _Run) -> list[Finding]:
    """TR204: TF32 or a lower float32 matmul precision."""
    settings = run.settings
    tf32 = []
    if settings.cuda_matmul_allow_tf32:
        tf32.append("torch.backends.cuda.matmul.allow_tf32 is on")
    precision = settings.float32_matmul_precision
    if precision not in (None, "highest"):
        tf32.append(f"float32 matmul precision is {precision!r}")
    if settings.cudnn_allow_tf32 and run.uses_conv:
        tf32.append("torch.backends.cudnn.allow_tf32 is on (the default) and the script convolves")
    if not tf32:
        return []
    return [
        settings_finding(
            "TR204",
            "info",
            "Reduced-precision float32 math: "
            + "; ".join(tf32)
            + ". Results are repeatable on the same hardware but differ from full float32 and between "
            "GPU generations (TF32 on Ampere and later; bf16 matmuls on some CPUs).",
            "torch.backends.cuda.matmul.allow_tf32 = False, torch.backends.cudnn.allow_tf32 = False, "
            "torch.set_float32_matmul_precision('highest') (strict mode does).",
        )
    ]


def _deterministic_off(run: _Run) -> list[Finding]:
    """TR205: deterministic algorithms are off and ops that need them ran."""
    if run.settings.deterministic_algorithms is not False or not run.needs_strict:
        return []
    return [
        settings_finding(
            "TR205",
            "warning",
            "Deterministic algorithms are off, and the script runs ops that are nondeterministic on CUDA "
            "without them: " + ", ".join(run.needs_strict) + ".",
            f"Turn strict mode on ({_STRICT}); it makes these ops deterministic at some speed cost.",
        )
    ]


def _warn_only(run: _Run) -> list[Finding]:
    """TR206: deterministic algorithms in warn-only mode (the ops that stay nondeterministic named)."""
    if not (run.settings.deterministic_algorithms and run.settings.warn_only):
        return []
    stays = ", ".join(run.cannot + run.needs_strict) or "none recorded in this run"
    return [
        settings_finding(
            "TR206",
            "warning",
            "Deterministic algorithms are in warn-only mode: ops without a deterministic implementation "
            f"only warn and stay nondeterministic (and so do SDPA backward kernels). Affected: {stays}.",
            "Use torch.use_deterministic_algorithms(True) without warn_only, and fix the ops it rejects.",
        )
    ]


def _threads(run: _Run) -> list[Finding]:
    """TR207: the thread count is pinned neither by the script nor by the environment."""
    settings = run.settings
    if settings.set_num_threads_called is not False or any(settings.thread_env.values()):
        return []
    return [
        settings_finding(
            "TR207",
            "warning",
            f"The thread count is not pinned (torch uses {settings.num_threads} threads here, from the "
            "machine's cores): CPU results (convolution backward, large sums) change with the thread "
            "count, so the same script differs between machines.",
            "Pin it: torchrepro run --threads N, OMP_NUM_THREADS=N, or torch.set_num_threads(N).",
        )
    ]


def processes(settings: ProbeSettings) -> list[Mapping[str, Any]]:
    """One summary per process of the run (``ProbeSettings.processes``; for a record of one
    process, that process alone)."""
    if settings.processes:
        return list(settings.processes)
    return [
        {
            "pid": settings.process.get("pid"),
            "main": True,
            "followed": True,
            "optimizer_steps": settings.optimizer_steps,
            "backward_steps": settings.backward_steps,
            "torch_seeded": settings.torch_seeded,
            "shared_updates": [dict(u) for u in settings.shared_updates],
        }
    ]


def steps_of(process: Mapping[str, Any]) -> int:
    """Training steps a process made: optimizer steps, and backward steps no optimizer saw."""
    return int(process.get("optimizer_steps") or 0) + int(process.get("backward_steps") or 0)


def _where(process: Mapping[str, Any]) -> str:
    if process.get("location"):
        return f"started at {process['location']}"
    argv = process.get("argv")
    if argv:
        return (
            "started as `" + " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv)) + "`"
        )
    return "started by the script"


def describe_processes(procs: Sequence[Mapping[str, Any]]) -> str:
    """``2 child processes started at train.py:11 (target train)``: grouped by where and what."""
    groups: dict[tuple[str, str | None], int] = {}
    for p in procs:
        key = (_where(p), p.get("target"))
        groups[key] = groups.get(key, 0) + 1
    parts = [
        (f"{n} " if len(groups) > 1 else "") + where + (f" (target {target})" if target else "")
        for (where, target), n in groups.items()
    ]
    noun = "child process" if len(procs) == 1 else "child processes"
    return f"{len(procs)} {noun} " + ("; ".join(parts) if len(parts) == 1 else "(" + "; ".join(parts) + ")")


def _torch_unseeded(run: _Run) -> list[Finding]:
    """TR208: torch's RNG is never seeded in the processes that trained (or, when none trained,
    in any process)."""
    procs = [p for p in processes(run.settings) if p.get("followed", True)]
    trainers = [p for p in procs if steps_of(p) > 0]
    if trainers:
        unseeded = [p for p in trainers if p.get("torch_seeded") is False]
    else:
        unseeded = [] if any(p.get("torch_seeded") is not False for p in procs) else procs[:1]
    if not unseeded:
        return []
    children = [p for p in unseeded if not p.get("main")]
    if len(children) == len(unseeded):
        return [
            settings_finding(
                "TR208",
                "warning",
                f"The {describe_processes(children)} train without seeding torch's RNG (a process "
                "started with spawn or forkserver does not inherit the parent's seed): initial weights, "
                "dropout masks and shuffling there differ every run.",
                "Seed at the start of each process's target (torch.manual_seed(seed + rank), or "
                "torchrepro.seed_everything(seed)), or run it with torchrepro run --seed N.",
            )
        ]
    return [
        settings_finding(
            "TR208",
            "warning",
            "The script never seeds torch's RNG: initial weights, dropout masks and shuffling differ "
            "every run.",
            "Call torchrepro.seed_everything(0) (or torch.manual_seed) before building the model, "
            "or run it with torchrepro run --seed N.",
        )
    ]


_LOWER = {"error": "warning", "warning": "info", "info": "info"}


def _unrun_switch(run: _Run, statement: Mapping[str, Any]) -> tuple[str, str, str, str] | None:
    """``(code, severity, effect, fix)`` of a switch statement that did not run, when it would
    matter (what the runtime rule would report) and the run does not already report it."""
    s = run.settings
    switch, value = statement.get("switch"), statement.get("value")
    tf32_fix = (
        "Set torch.backends.cuda.matmul.allow_tf32 = False, torch.backends.cudnn.allow_tf32 = False and "
        "torch.set_float32_matmul_precision('highest') on every device (strict mode does), or drop the line."
    )
    if switch == "cudnn_benchmark" and value is True and not s.cudnn_benchmark:
        return (
            "TR203",
            "warning",
            "turns cuDNN benchmarking on: cuDNN times candidate algorithms and may pick a different one "
            "each run",
            "Set torch.backends.cudnn.benchmark = False on every device (strict mode does), or drop "
            "the line.",
        )
    if switch == "cuda_matmul_allow_tf32" and value is True and not s.cuda_matmul_allow_tf32:
        return ("TR204", "info", "lets float32 matmuls run in TF32 (reduced precision)", tf32_fix)
    if switch == "cudnn_allow_tf32" and value is True and not s.cudnn_allow_tf32 and run.uses_conv:
        return ("TR204", "info", "lets the script's convolutions run in TF32 (reduced precision)", tf32_fix)
    if (
        switch == "float32_matmul_precision"
        and value in ("high", "medium")
        and s.float32_matmul_precision in (None, "highest")
    ):
        return ("TR204", "info", f"lowers the float32 matmul precision to {value!r} (TF32 or bf16)", tf32_fix)
    stays = ", ".join(run.cannot + run.needs_strict)
    if switch == "deterministic_algorithms" and value is False and s.deterministic_algorithms and stays:
        return (
            "TR205",
            "warning",
            f"turns the deterministic algorithms off, and the script runs ops nondeterministic on CUDA "
            f"without them: {stays}",
            f"Keep strict mode on every device ({_STRICT}).",
        )
    if (
        switch == "deterministic_algorithms"
        and value is True
        and statement.get("warn_only")
        and not (s.deterministic_algorithms and s.warn_only)
        and stays
    ):
        return (
            "TR206",
            "warning",
            f"makes the deterministic algorithms warn-only: {stays} only warn and stay nondeterministic",
            "Use torch.use_deterministic_algorithms(True) without warn_only on every device.",
        )
    if (
        switch == "cudnn_deterministic"
        and value is False
        and s.cudnn_deterministic
        and not s.deterministic_algorithms
        and run.uses_conv
    ):
        return (
            "TR205",
            "warning",
            "lets cuDNN pick nondeterministic convolution algorithms",
            f"Keep torch.backends.cudnn.deterministic = True on every device ({_STRICT}).",
        )
    return None


def _unrun_switches(run: _Run) -> list[Finding]:
    """TR203-TR206 for a switch set on a line that did not run here (a branch not taken on this
    machine: ``if torch.cuda.is_available():``), when the runtime rule would report it and does
    not already. Under a condition naming CUDA (a GPU, a device) the severity is the runtime
    rule's: that branch is the one a GPU run takes. Elsewhere one step lower: the audit cannot
    tell whether the script's real runs take it."""
    out = []
    for statement in run.settings.switch_statements:
        if statement.get("ran") is not False:
            continue
        judged = _unrun_switch(run, statement)
        if judged is None:
            continue
        code, severity, effect, fix = judged
        location = str(statement.get("location") or "")
        line = location.rpartition(":")[2] or "?"
        text = statement.get("text") or statement.get("switch")
        condition = statement.get("condition")
        if statement.get("cuda"):
            where = f"on a branch not taken in this run: line {line}, under `{condition}`"
            message = f"`{text}` ({where}): on CUDA it {effect}."
        else:
            severity = _LOWER[severity]
            where = f"on a line that did not run in this audit: line {line}" + (
                f", under `{condition}`" if condition else ""
            )
            message = (
                f"`{text}` ({where}): when it runs it {effect}. Reported one step lower than if it had "
                "run: whether the script's real runs take this line, the audit cannot tell."
            )
        out.append(settings_finding(code, severity, message, fix, location or None))
    return out


def _loaders(run: _Run) -> list[Finding]:
    """TR301-TR304, TR306: the DataLoaders, one finding per code and line (``audit.loader_rules``)."""
    # a loader of another process than the one the settings were read in carries its seeding
    return dataloader_findings(run.settings.dataloaders, run.settings.seeded)


def _tainted_seeds(run: _Run) -> list[Finding]:
    """TR305: seeds drawn from unseeded sources (``audit.loader_rules``)."""
    return [tainted_seed_finding(call) for call in run.settings.tainted_seeds]


def _compile(run: _Run) -> list[Finding]:
    """TR401: ``torch.compile`` with Inductor and without its deterministic mode, per line that
    calls it (a call in a loop, or in each process, is one finding that counts them)."""
    settings = run.settings
    if settings.deterministic_algorithms or settings.inductor_deterministic:
        return []
    lines: dict[Any, list[Mapping[str, Any]]] = {}
    for call in settings.compile_calls:
        if (call.get("backend") or "inductor") == "inductor":
            lines.setdefault(call.get("location"), []).append(call)
    out = []
    for location, calls in lines.items():
        modes = [str(m) for m in dict.fromkeys(c.get("mode") for c in calls) if m]
        autotune = [m for m in modes if "autotune" in m]
        out.append(
            settings_finding(
                "TR401",
                "warning",
                "torch.compile with Inductor and without its deterministic mode"
                + (f" ({len(calls)} calls at this line)" if len(calls) > 1 else "")
                + ": on GPU Inductor "
                "benchmarks and autotunes kernels (matmul padding, templates, reduction configs) and "
                "keeps the fastest, which can change the numerics from run to run"
                + (f"; mode={autotune[0]!r} autotunes even more." if autotune else "."),
                "Turn on deterministic algorithms (strict mode; it switches Inductor to its "
                "deterministic mode) or set torch._inductor.config.deterministic = True "
                "(TORCHINDUCTOR_DETERMINISTIC=1).",
                location,
            )
        )
    return out


def _no_training(run: _Run) -> list[Finding]:
    """TR003: no training step was seen in any process (optimizer steps, or backward steps where
    no optimizer steps); said differently when children ran that the audit did not follow."""
    procs = processes(run.settings)
    if any(steps_of(p) > 0 for p in procs):
        return []
    followed = [p for p in procs if not p.get("main") and p.get("followed", True)]
    unfollowed = [p for p in procs if not p.get("main") and not p.get("followed", True)]
    if unfollowed:
        return [
            settings_finding(
                "TR003",
                "info",
                "No training step was seen in this process (no optimizer step, no backward())"
                + (f" nor in the {describe_processes(followed)} the audit followed" if followed else "")
                + f"; the {describe_processes(unfollowed)} ran outside the audit ("
                + ("it" if len(unfollowed) == 1 else "they")
                + " wrote no record of "
                + ("its" if len(unfollowed) == 1 else "their")
                + " own: not a python with this environment, or ended before writing), so whatever "
                "ran there is not covered by these findings.",
                "Start training processes as python processes that keep the environment "
                "(multiprocessing or torch.multiprocessing with any start method, mp.spawn, or a "
                "subprocess of sys.executable), or audit the training function in one process.",
            )
        ]
    return [
        settings_finding(
            "TR003",
            "info",
            "The script made no optimizer step and ran no backward() while audited"
            + (f", nor did the {describe_processes(followed)}" if followed else "")
            + "; the findings cover what ran (an inference-only run records no backward ops).",
            "Audit with arguments under which the script trains (a short config is enough: the audit "
            "stops after --steps optimizer steps, or backward() steps where no optimizer steps).",
        )
    ]


def _overlap(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two processes one parent started ran at once: each started before the other was
    joined (positions on the parent's clock; never joined: to the end)."""
    end_a, end_b = a.get("joined"), b.get("joined")
    start_a, start_b = a.get("started"), b.get("started")
    if not isinstance(start_a, int) or not isinstance(start_b, int):
        return True  # a start the parent did not see: no proof they were apart
    return (end_b is None or start_a < end_b) and (end_a is None or start_b < end_a)


def _during(parent: Mapping[str, Any], child: Mapping[str, Any]) -> bool:
    """Whether a parent updated shared parameters while ``child`` ran (between its start and join)."""
    start, end = child.get("started"), child.get("joined")
    if not isinstance(start, int):
        return False
    return any(
        isinstance(u.get("last"), int) and u["last"] > start and (end is None or u.get("first", 0) < end)
        for u in parent.get("shared_updates") or ()
    )


def _hogwild(run: _Run) -> list[Finding]:
    """TR501: processes update the parameters of one module in shared memory at the same time."""
    procs = [p for p in processes(run.settings) if p.get("followed", True)]
    updaters = [p for p in procs if p.get("shared_updates")]
    together: dict[Any, Mapping[str, Any]] = {}
    for i, a in enumerate(updaters):
        for b in updaters[i + 1 :]:
            same_parent = (
                a.get("parent_pid") == b.get("parent_pid") and not a.get("main") and not b.get("main")
            )
            if (same_parent and _overlap(a, b)) or (
                (b.get("parent_pid") == a.get("pid") and _during(a, b))
                or (a.get("parent_pid") == b.get("pid") and _during(b, a))
            ):
                together[a.get("pid")] = a
                together[b.get("pid")] = b
    if len(together) < 2:
        return []
    group = list(together.values())
    updates = [u for p in group for u in p.get("shared_updates") or ()]
    module = next((u.get("module") for u in updates if u.get("module")), None) or "a module"
    variable = next((u.get("variable") for u in updates if u.get("variable")), None)
    shared = next((m for m in run.settings.shared_modules if m.get("class") == module), None) or next(
        iter(run.settings.shared_modules), None
    )
    if shared is not None:
        variable = shared.get("variable") or variable
    what = module + (f" `{variable}`" if variable else "")
    if shared is not None and shared.get("location"):
        what += f", put in shared memory at {shared['location']}"
    children = [p for p in group if not p.get("main")]
    who = describe_processes(children)
    if len(children) < len(group):
        who += " and the script's own process"
    steps = sum(int(u.get("steps") or 0) for u in updates)
    location = next((p.get("location") for p in children if p.get("location")), None)
    return [
        settings_finding(
            "TR501",
            "error",
            f"The {who} update the parameters of one module in shared memory at the same time "
            f"(hogwild): {what} ({steps} step(s) on it seen). Which update lands first, and which "
            "gradient was computed from which weights, depends on the OS scheduler, so the weights "
            "differ from run to run whatever the seeds and switches.",
            "Train in one process, or synchronise: each process its own copy of the model with "
            "DistributedDataParallel (gradients all-reduced in lock-step), or an explicit all-reduce "
            "of the gradients before every step. A lock around the step serialises the updates but "
            "not their order.",
            location,
        )
    ]


def _accumulation(run: _Run) -> list[Finding]:
    """TR502: gradients accumulated over several backward passes under stock DDP (``no_sync``) or
    FSDP2 (``set_requires_gradient_sync``), found in the source (on one process it does nothing:
    the bits it costs show on several)."""
    out = []
    for statement in run.settings.accumulation_statements:
        wrapper = statement.get("wrapper") or "DDP"
        out.append(
            settings_finding(
                "TR502",
                "warning",
                f"Gradient accumulation under stock {wrapper} (`{statement.get('text')}`): each rank sums "
                "its micro-batches' gradients, then the ranks' sums are reduced, so the order of the "
                "additions, and which micro-batches a rank holds, change with the number of processes; "
                "dropout draws from each rank's own stream. The weights depend on the world size, and a "
                "resume onto another world size does not continue the run.",
                "Iterate torchrepro.SeededLoader(dataset, batch_size=micro, global_batch_size=G, seed=...) "
                f"and wrap the model in torchrepro.InvariantDataParallel(model, loader) instead of {wrapper}"
                + (" (after fully_shard)" if wrapper == "FSDP2" else "")
                + ": the same bits on any world size dividing the micro-batch count, one backward per "
                "micro-batch, no no_sync.",
                statement.get("location"),
            )
        )
    return out


_RULES: tuple[Callable[[_Run], list[Finding]], ...] = (
    _hash_randomization,
    _cublas_workspace,
    _cudnn_benchmark,
    _reduced_precision,
    _deterministic_off,
    _warn_only,
    _threads,
    _torch_unseeded,
    _unrun_switches,
    _loaders,
    _tainted_seeds,
    _compile,
    _hogwild,
    _accumulation,
    _no_training,
)


def audit_settings(settings: ProbeSettings, *, events: Iterable[Any] = ()) -> list[Finding]:
    """Findings for the determinism settings a script ran with (what the probe saw).

    ``events`` (the recorded ops) decide which settings matter: the CUBLAS variable only when
    cuBLAS ops ran, deterministic mode only when ops that need it ran.

    >>> from torchrepro._child.probe import SettingsProbe
    >>> settings = SettingsProbe("unused.json").snapshot()  # a probe, not installed
    >>> "TR203" in [f.code for f in audit_settings(dataclasses.replace(settings, cudnn_benchmark=True))]
    True
    """
    run = _run(settings, events)
    return sorted(collapse(f for rule in _RULES for f in rule(run)), key=sort_key)
