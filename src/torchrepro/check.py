"""``torchrepro check``: run a script several times and report where the runs first part.

Invariants:
- All runs start together; every later run is compared live, event by event, against the first
  run, and at the first divergence every process is ended (early stop): a divergence at step 5
  of 500 costs about 5 steps, not two full runs.
- A run that fails (non-zero exit not caused by the check) makes the check a script failure,
  never a divergence; every process the check started is ended on return, on an exception,
  on Ctrl-C and on SIGTERM (process trees, torchrun ranks included).
- Each check writes only below its own fresh directory (``.torchrepro/checks/<id>/``): ``run<i>/``
  run records, ``locate<j>/`` trace re-runs, ``verdict.json``.
- The runs never write into the user's files: each run sees the working directory as the check
  found it plus its own writes, which end up in its record (``isolation``; off with
  ``isolate=False`` or where the kernel refuses, and then the verdict says so). Paths outside
  it that runs running at the same time both wrote are named (``shared_writes``); a run that
  failed after that is reported with them and the ways out, not as a plain script failure.
- ``serial`` runs one run at a time (each later run compared live against the complete first).
- The ranks compared are ``--nproc``'s and every rank a run's record shows (events files, the
  world sizes ranks noted when they joined a process group), so ranks the script starts itself
  are compared too; a rank that should exist but wrote no record, or a python child the script
  started that trained without a rank of its own, makes the verdict inconclusive with a note.
- A ``compute`` divergence at step k is located (op, module, line) by re-running both sides
  with op tracing for step k only; locating is best effort and never fails the check. Under
  ``--vary threads`` a located op is named as one whose CPU kernel splits work by thread: one
  ``--portable`` fixes, or one of the audit's table (``audit.threads``) that it does not.
- ``repro`` (``check --repro DIR``): a located op whose inputs were equal and outputs differed is
  called once more in a re-run of the first side that saves its inputs, and ``tracing.repro``
  writes a standalone script of it into DIR (new or empty, checked before any run); nothing is
  written, with a note saying why, for anything else.
- ``portable`` runs every run in portable mode; the verdict says so (``portable``: the values the
  runs started with), and a portable value kept from the user's environment gets a note.
- ``vary="world"`` runs the first run on 1 process and the later ones on ``nproc`` (default 2),
  all through torchrun with the same seed and the same thread count per process (``threads``,
  default 1), and compares rank 0 of the first against every rank of the others in what must
  not depend on the split of a global batch (``compare.WorldScope``); a divergence is explained
  in words, not located (op traces of different splits do not align).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrepro import runrecord
from torchrepro.check_runs import (
    CheckProgress,
    make_run,
    rank_notes,
    relayed,
    same_rank,
    varied_workers,
    watch,
    world_pair,
)
from torchrepro.compare.alignment import coverage, optimizer_steps, steps_compared
from torchrepro.errors import ReproError, SettingsError
from torchrepro.events import BACKWARD_KEY, optimizer_index
from torchrepro.isolation import Layers, describe_shared, probe, shared_writes
from torchrepro.launch import (
    build_command,
    check_target,
    nproc_note,
    run_settings,
    start_notes,
    terminate_on_signals,
)
from torchrepro.nodes import Nodes
from torchrepro.options import VARY_CHOICES, CheckOptions
from torchrepro.portable import CBWR_VAR, CPU_CAPABILITY_VAR
from torchrepro.protocol import INDUCTOR_CACHE_VAR, ChildSpec, python_hash_seed
from torchrepro.results import (
    CheckResult,
    CompileScope,
    Coverage,
    Divergence,
    Isolation,
    StepGap,
    WorldScope,
)
from torchrepro.tracing.locate import locate_in_traces
from torchrepro.verdict import (
    FINAL_NOT_LOCATED,
    WORLD_NOT_LOCATED,
    describe_isolation,
    final_state_reason,
    inconclusive_verdict,
    world_divergence_reason,
)

if TYPE_CHECKING:
    from torchrepro.results import Repro

__all__ = ["VARY_CHOICES", "CheckOptions", "CheckProgress", "CheckResult", "check_script"]

WORLD_DEFAULT_NPROC = 2
"""The processes of the later runs of ``--vary world`` when ``--nproc`` is not given."""

COMPILE_STEPS_AFTER = 20
"""``--vary compile``: the runs go on at least this many steps after they part, so the verdict (and
the report's plot) gives the difference per step as it grows, not just where it starts."""

LOCATE_ATTEMPTS = 3


def _run_spec(base: ChildSpec, vary: str | None, index: int, *, seed: int) -> ChildSpec:
    """The spec of run ``index``: ``base`` with what ``--vary`` changes in later runs."""
    if vary is None:
        return base
    if vary == "threads":
        first = base.threads or 1
        return base.replace(threads=first if index == 0 else (2 if first == 1 else 1))
    if vary == "hashseed":
        return base.replace(hash_seed=python_hash_seed(seed, "vary", index))
    if vary == "workers":
        return base.replace(num_workers="other") if index > 0 else base
    if vary == "world":  # every process gets the same threads: only the number of processes varies
        return base.replace(threads=base.threads or 1)
    if vary == "resume":  # every run notes its states; check_resume kills and restarts the later ones
        return base.replace(resume_states=True)
    if vary == "compile":  # the first run eager, the later ones as the script compiles
        return base.replace(compile="eager" if index == 0 else "compiled")
    raise SettingsError(f"vary must be one of {VARY_CHOICES} or None, got {vary!r}")


_AGREED = (
    *("runs", "steps", "nproc", "seed", "mode", "threads", "cpu_capability", "no_seed", "vary"),
    *("portable", "serial", "locate", "isolate"),
)
"""The options every node of a check across nodes must be started with (the leader's decide)."""


def _world_sizes(vary: str | None, nproc: int | None, runs: int) -> list[int | None]:
    """The ``--nproc`` of each run: ``nproc`` for all, or with ``--vary world`` 1 process for the
    first run and ``nproc`` (default 2) for the others."""
    if vary != "world":
        return [nproc] * runs
    larger = WORLD_DEFAULT_NPROC if nproc is None else nproc
    if larger < 2:
        raise SettingsError(
            f"--vary world compares 1 process with --nproc N processes (default {WORLD_DEFAULT_NPROC}), "
            f"so N must be >= 2, got {larger}"
        )
    return [1, *[larger] * (runs - 1)]


def _args_text(args: Sequence[str], later_args: Sequence[str]) -> str:
    """What ``later_args`` changed, in words: ``arguments 'a' vs 'b'``."""
    return f"arguments {shlex.join(args) or '(none)'!r} vs {shlex.join(later_args) or '(none)'!r}"


def _varied_text(vary: str | None, specs: Sequence[ChildSpec]) -> str | None:
    """What ``--vary threads|hashseed|compile`` changed, in words (``1 vs 2 threads``); workers: None
    (the runs' records say, ``check_runs.varied_workers``); world: ``WorldScope.varied``."""
    if vary == "threads":
        counts = [s.threads for s in specs]
        return f"{counts[0]} vs {counts[1]} threads" if counts[0] != counts[1] else None
    if vary == "hashseed":
        seeds = list(dict.fromkeys(str(s.hash_seed) for s in specs))
        return f"PYTHONHASHSEED {seeds[0]} vs {', '.join(seeds[1:])}" if len(seeds) > 1 else None
    if vary == "compile":
        return "eager vs torch.compile"
    return None


def _steps_note(steps: int, covered: Coverage, compared: int, *, unrecorded: bool) -> str | None:
    """What became of ``--steps N`` in runs that ran to their end (None: it was applied)."""
    if covered.per_kind.get("compute", 0) == 0 and unrecorded:
        return (
            f"--steps {steps} could not be applied to what was compared: no training step was recorded; "
            "the training ran in python processes torchrepro does not record (see the notes), each "
            f"stopped after {steps} steps of its own but none of them compared"
        )
    if covered.per_kind.get("compute", 0) == 0:
        return (
            f"--steps {steps} was not applied: the script took no optimizer step and ran no backward() "
            "that torchrepro counts, so every run ran to its end"
        )
    if compared < steps:
        return f"--steps {steps}: the script ended after {compared} training step(s), before step {steps}"
    return None


def _varied_setting(specs: tuple[ChildSpec, ChildSpec]) -> str | None:
    """How ``--vary threads`` started the two located runs differently, in words (else None)."""
    a, b = specs
    if a.threads is None or b.threads is None or a.threads == b.threads:
        return None

    def threads(n: int) -> str:
        return f"{n} thread{'s' if n != 1 else ''}"

    return f"between {threads(a.threads)} (first run) and {threads(b.threads)} (other run)"


def check_script(
    script: str | None,
    args: Sequence[str] = (),
    *,
    module: str | None = None,
    options: CheckOptions | None = None,
    later_args: Sequence[str] | None = None,
    progress: Callable[[CheckProgress], None] | None = None,
    **option_values: Any,
) -> CheckResult:
    """Run ``script`` (or ``module``) with ``args`` several times under ``torchrepro run``'s settings
    and compare the runs live.

    ``options`` (``CheckOptions``) says how, with any of its fields given by name on top
    (``check_script("train.py", runs=3, vary="threads")``): the runs, their settings, what the
    later runs vary, locating, isolation, where the records go. ``later_args``: the runs after the
    first get these arguments instead of ``args`` (a variant of the script compared against it: a
    run resumed midway against one that was not). ``progress`` is called with the steps each run
    reached as they advance, and when locating starts.

    Raises ``LaunchError`` when the script or module does not exist and ``SettingsError`` for
    invalid options (``TypeError`` for an unknown one); a failing script is a ``CheckResult`` with
    ``error`` set.
    """
    opts = CheckOptions.build(options, **option_values)
    base = ChildSpec(
        cpu_capability=opts.cpu_capability,
        seed=None if opts.no_seed else opts.seed,
        mode=None if opts.no_seed else opts.mode,
        threads=opts.threads,
        max_steps=opts.steps,
        portable=opts.portable,
    )
    repro_dir = None
    if opts.repro is not None:
        from torchrepro.tracing.repro import prepare_dir

        repro_dir = prepare_dir(opts.repro)
    portable_notes = start_notes(base)  # a value it cannot use is refused before anything is created
    check_target(script, module, args, command="check")
    worlds = _world_sizes(opts.vary, opts.nproc, opts.runs)
    control = None
    launch_nodes = None  # across nodes: what each run's torchrun launch is given
    if opts.nodes is not None:  # lead the check across nodes, or follow it (check_nodes)
        from torchrepro.check_nodes import Relay, connect

        agreed: dict[str, Any] = {"script": script, "module": module, "args": list(args)}
        agreed["later_args"] = None if later_args is None else list(later_args)
        for name in _AGREED:
            agreed[name] = getattr(opts, name)
        control = connect(opts.nodes, agreed)
        launch_nodes = Relay.nodes_of(control)
    commands = [  # validates nproc
        build_command(
            script,
            args if i == 0 or later_args is None else later_args,
            module=module,
            nproc=n,
            watch_writes=True,
            nodes=launch_nodes,
        )
        for i, n in enumerate(worlds)
    ]
    check_dir = runrecord.new_run_dir(runrecord.CHECKS_ROOT if opts.root is None else opts.root)
    isolation, layers = _isolation(check_dir, enabled=opts.isolate)
    repro_threads = opts.repro_threads and repro_dir is None and opts.vary == "threads" and opts.locate
    # SIGTERM ends the check as Ctrl-C does (its runs stopped, exit 128+15) in every phase and
    # between them: a signal after the last run ended must not kill it with its layers still open
    with terminate_on_signals(), contextlib.ExitStack() as cleanup:
        if layers is not None:
            cleanup.callback(layers.close)
        relay = None
        if control is not None:
            from torchrepro.check_nodes import follow, lead

            if not control.leader:
                return follow(control, check_dir, layers, poll_interval=opts.poll_interval)
            relay = cleanup.enter_context(lead(control, check_dir))
            cleanup.enter_context(relayed(relay))
        if opts.vary == "resume":  # refused across nodes (options)
            from torchrepro.check_resume import check_resume

            resume_command = build_command(
                script, [*args, *opts.resume_args], module=module, nproc=opts.nproc, watch_writes=True
            )
            return check_resume(
                check_dir,
                commands[0],
                resume_command,
                base,
                opts,
                isolation=isolation,
                layers=layers,
                script=script,
                module=module,
                progress=progress,
                start_notes=[n for n in [nproc_note(opts.nproc), *portable_notes] if n],
            )
        result = _check(
            check_dir,
            commands,
            base,
            opts,
            isolation=isolation,
            layers=layers,
            script=script,
            module=module,
            nprocs=worlds,
            varied_args=None if later_args is None else _args_text(args, later_args),
            progress=progress,
            start_notes=portable_notes,
            repro_dir=repro_dir,
            repro_threads=repro_threads,
            nodes=launch_nodes,
        )
        if relay is not None:  # every other node prints this verdict and exits with its code
            where = os.path.abspath(result.check_dir)
            relay.post({"verdict": result.to_dict(), "check_dir": where, "stderr_tail": result.stderr_tail})
        return result


_OPTED_OUT = "--no-isolate"
"""The reason of runs not isolated because the user asked (the verdict adds no note for it)."""


def _isolation(check_dir: Path, *, enabled: bool) -> tuple[Isolation, Layers | None]:
    """How this check's runs are kept apart, and where their upper layers live."""
    root = os.path.realpath(os.getcwd())
    if not enabled:
        return Isolation(mode="none", root=root, reason=_OPTED_OUT), None
    layers = Layers.create(check_dir, root)
    if layers is None:
        reason = "no writable directory outside it for the runs' writes"
        return Isolation(mode="none", root=root, reason=reason), None
    user_namespace, refused = probe(layers)
    if refused is not None:
        layers.close()
        return Isolation(mode="none", root=root, reason=f"the kernel refused an overlay ({refused})"), None
    return Isolation(mode="overlay", root=root, user_namespace=user_namespace), layers


def _check(
    check_dir: Path,
    commands: list[list[str]],
    base: ChildSpec,
    options: CheckOptions,
    *,
    isolation: Isolation,
    layers: Layers | None,
    script: str | None,
    module: str | None,
    nprocs: list[int | None],
    varied_args: str | None,
    progress: Callable[[CheckProgress], None] | None,
    start_notes: Sequence[str] = (),
    repro_dir: Path | None = None,
    repro_threads: bool = False,
    nodes: Nodes | None = None,
) -> CheckResult:
    """The check of ``check_script``: ``commands`` holds each run's command line (``nodes``: the
    nodes each run spans, ``nprocs`` processes on each)."""
    nnodes = 1 if nodes is None else nodes.nnodes
    runs, vary, serial, poll_interval = options.runs, options.vary, options.serial, options.poll_interval
    nproc = nprocs[-1]  # the most processes a run has (--vary world: the later runs)
    world = WorldScope(1, nproc) if vary == "world" and nproc is not None else None
    specs = [_run_spec(base, vary, i, seed=options.seed) for i in range(runs)]
    if world is not None:  # FSDP2's shards differ by world size: recorded whole, they compare
        specs = [s.replace(whole_shards=True) for s in specs]
    if vary == "compile":  # each compiled run starts with an empty Inductor cache of the check's own
        specs = [
            s.replace(compile_cache=os.fspath((check_dir / f"inductor{i}").resolve())) if i > 0 else s
            for i, s in enumerate(specs)
        ]
    all_runs = [
        make_run(
            i, check_dir / f"run{i}", commands[i], specs[i], ranks=(nprocs[i] or 1) * nnodes, layers=layers
        )
        for i in range(runs)
    ]
    for run in all_runs:
        runrecord.write_run_files(
            run.record_dir,
            run.command,
            run_settings(
                specs[run.index] if world is not None else base,  # --vary world pins the threads
                run.env,
                script=script,
                module=module,
                nproc=nprocs[run.index] or (1 if nnodes > 1 else None),
                vary=vary,
                run=run.index,
                nodes=nodes,
            ),
        )
    notes = [n for n in [nproc_note(nproc), *start_notes] if n]
    portable = _portable_values(all_runs[0].env) if base.portable else None
    if world is not None:
        threads = specs[0].threads
        notes.append(
            f"--vary world: run 1 on 1 process, the other run(s) on {nproc} processes (each through "
            f"torchrun), every process with {threads} thread{'s' if threads != 1 else ''} (--threads) "
            "and the same seed"
        )
    if isolation.mode == "none" and isolation.reason != _OPTED_OUT:
        notes.append(f"the runs were not isolated: {describe_isolation(isolation)}")
    try:
        with terminate_on_signals():
            divergences, cursors, failed = watch(
                all_runs,
                progress=progress,
                poll_interval=poll_interval,
                serial=serial,
                pair=same_rank if world is None else world_pair,
                linger=(
                    max(options.steps_after_divergence, COMPILE_STEPS_AFTER)
                    if vary == "compile"
                    else options.steps_after_divergence
                ),
            )
    finally:
        for run in all_runs:
            run.stop()
    ranks = max(run.ranks for run in all_runs)  # with the ranks the script started itself
    unranked = rank_notes(all_runs, (nproc or 1) * nnodes)  # the ranks torchrepro started
    notes.extend(unranked)
    together = [] if serial else [range(runs)]
    shared = shared_writes(
        [run.record_dir for run in all_runs], together, isolation=isolation, check_dir=check_dir
    )
    if failed is not None:
        how = failed.failure or f"with exit code {failed.returncode}"
        error = f"run {failed.index + 1} of {runs} failed {how}"
        if shared:
            error += f" after {describe_shared(shared, isolation=isolation)}"
        result = CheckResult(
            reproducible=None,
            runs=runs,
            steps_compared=steps_compared(cursors),
            first_divergence=None,
            check_dir=os.fspath(check_dir),
            error=error,
            returncode=failed.returncode,
            stderr_tail=failed.stderr_tail(),
            notes=tuple(notes),
            coverage=coverage(cursors, range(ranks)),
            isolation=isolation,
            shared_writes=tuple(shared),
            portable=portable,
            world=world,
        )
        runrecord.write_verdict(check_dir, result.to_dict())
        return result
    other, first = divergences[0] if divergences else (1, None)
    covered = coverage(cursors, range(ranks))
    reason: str | None = None
    located_in: Path | None = None
    graph: str | None = None  # --vary compile: the compiled graph located
    if first is not None and world is not None:  # op traces of different splits do not align
        reason = world_divergence_reason(world, first)
        notes.append(WORLD_NOT_LOCATED)
    elif first is not None and first.final_state:  # no recorded step differs: nothing to trace
        reason = final_state_reason(first, covered, unrecorded=bool(unranked))
        notes.append(FINAL_NOT_LOCATED)
    elif first is not None and first.kind == "compute" and options.locate and vary == "compile":
        if progress is not None:
            progress(CheckProgress(phase="locating", steps=()))
        with terminate_on_signals():
            first, graph, locate_notes = _locate_compiled(
                first,
                check_dir,
                commands[other],
                specs[other],
                ranks=ranks,
                layers=layers,
                poll_interval=poll_interval,
            )
        notes.extend(locate_notes)
    elif first is not None and first.kind == "compute" and options.locate:
        if progress is not None:
            progress(CheckProgress(phase="locating", steps=()))
        with terminate_on_signals():  # SIGTERM while locating ends the traced re-runs too
            first, locate_notes, located_in = _locate(
                first,
                check_dir,
                (commands[0], commands[other]),
                (specs[0], specs[other]),
                ranks=ranks,
                layers=layers,
                progress=progress,
                poll_interval=poll_interval,
                serial=serial,
            )
        notes.extend(locate_notes)
    if first is not None and vary == "threads":
        notes.extend(_thread_notes(first.op, portable=base.portable))
    repro: Repro | None = None
    if repro_threads and first is not None and first.op is not None:  # check_script: no repro_dir
        repro_dir = check_dir / "repro" / "script"  # the op under both thread counts, for a report
    if repro_dir is not None:
        with terminate_on_signals():
            repro, repro_note = _repro(
                repro_dir,
                first,
                located_in,
                check_dir=check_dir,
                command=commands[0],
                specs=(specs[0], specs[other]),
                ranks=ranks,
                layers=layers,
                poll_interval=poll_interval,
            )
        notes.append(repro_note)
    if nnodes > 1:
        notes.extend(_node_notes(all_runs[0], first))
    reproducible: bool | None = first is None
    inconclusive = None
    if first is None:
        unranked_note = "inconclusive: a python process the script started trained unrecorded (above)"
        inconclusive = inconclusive_verdict(covered, world, bool(unranked), unranked_note)
    if inconclusive is not None:
        reproducible = None
        reason, note = inconclusive
        notes.append(note)
    varied = world.varied if world is not None else _varied_text(vary, specs)
    if vary == "workers" and runs > 1:
        varied_note, varied, nothing = varied_workers(all_runs[1], ranks)
        notes.append(varied_note)
        if first is None and nothing is not None and reproducible:
            reproducible = None
            reason = nothing
            notes.append(
                "inconclusive: --vary workers varied nothing (the script created no DataLoader), so "
                "the runs were not loaded differently; the verdict would only repeat a plain check"
            )
    compiled: CompileScope | None = None
    if vary == "compile":
        compiled = _compile_scope(all_runs, graph)
        if compiled.compiles == 0:
            notes.append(
                "--vary compile varied nothing: the compiled run finished no compilation (the script "
                "never calls torch.compile, or everything it compiled fell back to eager)"
            )
            if reproducible:
                reproducible = None
                reason = "--vary compile varied nothing: the script compiled nothing"
    if varied_args is not None:
        varied = varied_args if varied is None else f"{varied}; {varied_args}"
    compared = steps_compared(cursors)
    if base.max_steps is not None and (first is None or first.final_state):  # the runs ran to their end
        steps_note = _steps_note(base.max_steps, covered, compared, unrecorded=bool(unranked))
        if steps_note is not None:
            notes.append(steps_note)
    if shared:
        notes.append(describe_shared(shared, isolation=isolation))
    result = CheckResult(
        reproducible=reproducible,
        runs=runs,
        steps_compared=compared,
        first_divergence=first,
        check_dir=os.fspath(check_dir),
        notes=tuple(notes),
        coverage=covered,
        isolation=isolation,
        shared_writes=tuple(shared),
        reason=reason,
        varied=varied,
        optimizer_steps=optimizer_steps(cursors),
        portable=portable,
        world=world,
        repro=repro,
        compile=compiled,
    )
    runrecord.write_verdict(check_dir, result.to_dict())
    return result


def _node_notes(a: Any, first: Divergence | None) -> list[str]:
    """Across nodes: the node (and host) of the first divergence's rank, and every node whose
    environment differs, in what can change bits, from the leader's (``compare.settings``)."""
    from torchrepro.compare.settings import node_notes

    try:
        record = runrecord.load_run(a.record_dir)  # every run of a check ran on the same nodes
    except ReproError:
        return []  # a run that recorded nothing: the verdict says so already
    return list(dict.fromkeys(node_notes(record, record, None if first is None else first.rank)))


def _compile_scope(all_runs: Sequence[Any], graph: str | None) -> CompileScope:
    """What ``--vary compile`` compared: the compilations of the later runs, the switch they ran
    with (run 2's environment record) and run 2's distance from eager at every compared step."""
    from torchrepro.report.distances import record_series

    eager, later = all_runs[0], all_runs[1]
    compiles = sum(runrecord.compiled_count(run.record_dir) for run in all_runs[1:])
    fallback_random = False
    steps: tuple[StepGap, ...] = ()
    try:
        a, b = runrecord.load_run(eager.record_dir), runrecord.load_run(later.record_dir)
        fallback_random = bool(((b.env or {}).get("determinism") or {}).get("inductor_fallback_random"))
        series = record_series(a, b, label="compiled vs eager")
        steps = tuple(
            StepGap(p.step, p.differing, p.tensors, p.largest, exact=p.exact, nonfinite=p.nonfinite)
            for p in series.points
        )
    except ReproError:
        pass  # a run that recorded nothing: the verdict says so already
    return CompileScope(
        compiles=compiles,
        fallback_random=fallback_random,
        cache=later.env.get(INDUCTOR_CACHE_VAR),
        steps=steps,
        graph=graph,
    )


def _portable_values(env: dict[str, str]) -> dict[str, Any]:
    """What portable mode set in a run started with ``env``, for the verdict."""
    return {CBWR_VAR: env.get(CBWR_VAR), CPU_CAPABILITY_VAR: env.get(CPU_CAPABILITY_VAR), "onednn": False}


def _thread_notes(op: str | None, *, portable: bool) -> list[str]:
    """What ``--vary threads`` learnt from the op a divergence was located at (None: not located)."""
    from torchrepro.audit.threads import portable_removes, thread_entry

    entry = thread_entry(op)
    if entry is not None:
        return [
            f"{op} is known to depend on the thread count on the CPU, also under --portable "
            f"(audit {entry.code}, {entry.title}); fix: {entry.fix}"
        ]
    removes = portable_removes(op)
    if removes is not None and not portable:
        return [f"{op} depends on the thread count here: {removes}; try the check again with --portable"]
    return []


def _locate(
    first: Divergence,
    check_dir: Path,
    commands: tuple[list[str], list[str]],
    specs: tuple[ChildSpec, ChildSpec],
    *,
    ranks: int,
    layers: Layers | None,
    progress: Callable[[CheckProgress], None] | None,
    poll_interval: float,
    serial: bool = False,
) -> tuple[Divergence, list[str], Path | None]:
    """Re-run both sides with op tracing at the divergent step; fill op/module/location. Also
    returns the ``locate<j>`` directory whose traces located it (None: not located)."""
    k = first.step
    notes: list[str] = []
    for attempt in range(LOCATE_ATTEMPTS):
        base = check_dir / f"locate{attempt}"
        sides = []
        for side, (index, spec), command in zip("ab", enumerate(specs), commands, strict=True):
            traced = spec.replace(
                max_steps=k + 1,
                trace_step=k,
                trace_out=os.fspath((base / f"trace-{side}").resolve()),
                trace_optimizer=optimizer_index(first.key),
            )
            sides.append(make_run(index, base / f"run-{side}", command, traced, ranks=ranks, layers=layers))
        try:
            divergences, _, failed = watch(
                sides, progress=None, poll_interval=poll_interval, stop_early=False, serial=serial
            )
        except Exception as exc:
            notes.append(f"locating failed: {type(exc).__name__}: {exc}")
            return first, notes, None
        finally:
            for run in sides:
                run.stop()
        if failed is not None:
            how = failed.failure or f"with exit code {failed.returncode}"
            notes.append(f"locating: the traced re-run failed {how}")
            return first, notes, None
        traces = [
            (r, runrecord.trace_path(base / "trace-a", r), runrecord.trace_path(base / "trace-b", r))
            for r in range(ranks)
        ]
        traces = [(r, a, b) for r, a, b in traces if a.exists() and b.exists()]
        if not traces:
            notes.append(f"locating: {_no_trace(first, base, ranks)}")
            return first, notes, None
        located, compare_notes, failed_ranks = locate_in_traces(first, traces, varied=_varied_setting(specs))
        notes.extend(f"locating: {note}" for note in compare_notes)
        if located is not None:
            return located, notes, base
        if failed_ranks:
            ranks_text = ", ".join(map(str, failed_ranks))
            notes.append(
                f"locating: the op traces of rank(s) {ranks_text} could not be compared: the op is unknown"
            )
            return first, notes, None
        same = not divergences
        what = (
            f"did not diverge at step {k} (intermittent nondeterminism)"
            if same
            else "diverged, but no op with equal inputs and different outputs was found"
        )
        notes.append(f"locating attempt {attempt + 1}: the traced re-runs {what}")
    return first, notes, None


def _locate_compiled(
    first: Divergence,
    check_dir: Path,
    command: list[str],
    spec: ChildSpec,
    *,
    ranks: int,
    layers: Layers | None,
    poll_interval: float,
) -> tuple[Divergence, str | None, list[str]]:
    """``--vary compile``: re-run the compiled side to the divergent step with its compiled graphs
    compared, call by call, against eager runs of the same graphs (``tracing.compiled``); fill the
    op, module and line of the first node whose compiled value differs. Op tracing cannot do this:
    compiled code dispatches no op one by one (and under a dispatch mode Dynamo runs eagerly).
    Returns the divergence, the located graph in words (None: not located) and notes."""
    from torchrepro.tracing.compiled import read_compiled_probe

    k = first.step
    base = check_dir / "locate-compiled"
    probed = spec.replace(
        max_steps=k + 1,
        trace_step=k,
        trace_out=os.fspath((base / "probe").resolve()),
        trace_optimizer=optimizer_index(first.key),
        compile_probe=True,
    )
    run = make_run(1, base / "run", command, probed, ranks=ranks, layers=layers)
    try:
        _, _, failed = watch([run], progress=None, poll_interval=poll_interval, stop_early=False)
    except Exception as exc:
        return first, None, [f"locating failed: {type(exc).__name__}: {exc}"]
    finally:
        run.stop()
    if failed is not None:
        return first, None, [f"locating: the probed re-run failed with exit code {failed.returncode}"]
    ranks_order = [first.rank, *(r for r in range(ranks) if r != first.rank)]
    for r in ranks_order:
        try:
            found = read_compiled_probe(runrecord.trace_path(base / "probe", r))
        except ReproError as exc:
            return first, None, [f"locating: {exc}"]
        if found is None:
            continue
        notes = [f"locating: {note}" for note in found.notes]
        if not found.found:
            notes.append(
                f"locating: at step {k} {found.describe()}; the difference comes from outside the "
                "compiled graphs (a graph break's eager code, or an op Dynamo did not capture)"
            )
            return first, None, notes
        if found.inductor_random:
            ops = ", ".join(found.random_ops)
            notes.append(
                f"locating: Inductor draws its own random numbers in that graph ({ops}; fallback_random "
                "was off): they never match eager's. Strict mode (the default) turns fallback_random on"
            )
        if found.node_found and found.phase == "forward":
            first = dataclasses.replace(first, op=found.op, module=found.module, location=found.line)
        return first, found.describe(), notes
    return first, None, [f"locating: the probed re-run of step {k} wrote no graph comparison"]


def _repro(
    directory: Path,
    first: Divergence | None,
    located_in: Path | None,
    *,
    check_dir: Path,
    command: list[str],
    specs: tuple[ChildSpec, ChildSpec],
    ranks: int,
    layers: Layers | None,
    poll_interval: float,
) -> tuple[Repro | None, str]:
    """``--repro``: re-run the first side once more, saving the inputs of the located op call,
    and write the standalone script into ``directory``; or the note saying why not."""
    from torchrepro.tracing.repro import SCRIPT_FILE, target, write_repro

    nothing = "--repro: no script written"
    if first is None:
        return None, f"{nothing}: the runs did not differ"
    if first.kind != "compute" or first.op is None:
        why = "it was not located" if first.kind == "compute" else f"it is a {first.kind} divergence"
        return None, f"{nothing}: the runs differ, but {why}; a script reproduces a located op"
    chosen = target(first.step, first.rank, located_in, threads=(specs[0].threads, specs[1].threads))
    if isinstance(chosen, str):
        return None, f"{nothing}: {chosen}"
    base = check_dir / "repro"
    spec = specs[0].replace(
        max_steps=first.step + 1,
        trace_step=first.step,
        trace_out=os.fspath((base / "trace").resolve()),
        trace_optimizer=optimizer_index(first.key),
        capture_op=chosen.op.index,
        capture_out=os.fspath((base / "capture").resolve()),
    )
    module = "outside any module" if first.module is None else f"in module {first.module!r}"
    where = f"at training step {first.step}, {module}, {first.location or 'line unknown'}"
    run = make_run(0, base / "run", command, spec, ranks=ranks, layers=layers)
    try:  # best effort, like locating: never fails the check
        _, _, failed = watch([run], progress=None, poll_interval=poll_interval, stop_early=False)
        if failed is not None:
            return (
                None,
                f"{nothing}: the re-run that saves the op's inputs failed (exit code {failed.returncode})",
            )
        written = write_repro(directory, chosen, base / "capture", where=where)
    except Exception as exc:
        return None, f"{nothing}: {type(exc).__name__}: {exc}"
    finally:
        run.stop()
    if isinstance(written, str):
        return None, f"{nothing}: {written}"
    script = os.path.join(os.fspath(directory), SCRIPT_FILE)
    shown = {
        True: "run once here in a fresh process, it showed the difference",
        False: "run once here in a fresh process, it did NOT show the difference: the op's result "
        "depends on more than its inputs and the thread count",
        None: "run once here in a fresh process, it did not finish",
    }[written.reproduces]
    return written, f"--repro: wrote a standalone reproduction of {written.op}: python {script} ({shown})"


_TRACING_UNAVAILABLE = "op tracing unavailable:"
"""What a traced re-run prints when the tracer could not start (``_child.session``)."""


def _no_trace(first: Divergence, base: Path, ranks: int) -> str:
    """Why the traced re-runs under ``base`` wrote no op trace of ``first``'s step, as found."""
    sides = [base / "run-a", base / "run-b"]
    for side in sides:
        try:
            text = (side / runrecord.STDERR_FILE).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if _TRACING_UNAVAILABLE in line:
                cause = line.split(_TRACING_UNAVAILABLE, 1)[1].strip()
                return f"no op trace was written: op tracing could not start in the traced re-run ({cause})"
    reached = 0
    for r in range(ranks):
        try:
            events = runrecord.read_events(runrecord.events_path(sides[0], r))
        except ReproError:
            continue
        steps = {e["step"] for e in events if e["kind"] == "compute" and e["key"] == first.key}
        reached = max(reached, len(steps))
    what = "backward() steps" if first.key == BACKWARD_KEY else f"steps of {first.key}"
    if reached <= first.step:
        return (
            f"no op trace was written: the traced re-runs recorded {reached} {what} and never reached "
            f"step {first.step}, where tracing starts (the script took another path than in the check)"
        )
    return (
        f"no op trace was written although the traced re-runs reached step {first.step}: it ran in a "
        "process that does not trace (a forked process, or a python child with no rank of its own)"
    )
