"""The ``torchrepro`` command line: parse, call one library function, render, exit code.

Exit codes everywhere: 0 = reproducible / OK, 1 = not reproducible / findings, 2 = usage error
(one line on stderr, before anything is created) or the script itself failed, 3 = inconclusive
(``check``/``compare``: no difference, but nothing beyond ``init`` compared on some rank); ``run`` passes
the script's code through, 128+N for a death by signal N (and so does an interrupted command).
``-m MODULE`` ends torchrepro's options as in python. With ``--json`` stdout holds exactly one
JSON object; progress and messages go to stderr. The library never prints; only this module does.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from torchrepro._version import __version__
from torchrepro.errors import ReproError
from torchrepro.options import VARY_CHOICES, CheckOptions
from torchrepro.verdict import describe_check, describe_comparison

if TYPE_CHECKING:
    from torchrepro.audit import AuditReport
    from torchrepro.env import EnvDifference

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_INCONCLUSIVE = 3

REPORT_STEPS_AFTER = 20
"""With ``check --report``, the runs go on for up to this many steps after the first divergence."""


class _Parser(argparse.ArgumentParser):
    """A usage error is one line (what was wrong, where to look) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        global _usage_error
        _usage_error = f"{message} (see `{self.prog} --help`)"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_usage_error}\n")


_usage_error: str | None = None
"""The last usage error a parser reported (``main`` prints it as JSON under ``--json``)."""


def _json_error(command: str | None, message: str, kind: str) -> None:
    """The error as one JSON object on stdout (``--json``): a program reading stdout gets JSON."""
    import json

    print(
        json.dumps({"error": {"kind": kind, "command": command, "message": message, "exit_code": EXIT_USAGE}})
    )


class _TopParser(_Parser):
    """The ``torchrepro`` parser: ``-m MODULE`` ends torchrepro's options, as in python."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        own, target = _split_module(self, list(sys.argv[1:] if args is None else args))
        parsed = super().parse_args(_joined_values(own), namespace)
        if target is not None:
            rest = target[1:]
            if rest[:1] == ["--"]:  # `-m pkg -- --flag`, the spelling that worked before: same meaning
                rest = rest[1:]
            parsed.module, parsed.args = target[0], rest
        return parsed


_JOINED = ("--resume-args",)
"""Options whose value is a script's arguments, so it starts with ``-`` more often than not."""


def _joined_values(argv: list[str]) -> list[str]:
    """``--resume-args "--resume x"`` as ``--resume-args=--resume x`` (argparse takes a value that
    starts with ``-`` for an option), up to the script: what follows it is the script's."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--", "-m") or (not arg.startswith("-") and arg.endswith(".py")):
            return out + argv[i:]
        if arg in _JOINED and i + 1 < len(argv):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def _add_script_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        dest="module",
        metavar="MODULE",
        help="run a module, like python -m: every argument after it is the module's",
    )
    p.add_argument("script", nargs="?", help="the training script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script or module")


def _add_cpu_capability(p: argparse.ArgumentParser) -> None:
    from torchrepro.protocol import CPU_CAPABILITIES

    p.add_argument(
        "--cpu-capability",
        choices=CPU_CAPABILITIES,
        default=None,
        metavar="ISA",
        help="pin the CPU instruction set torch's kernels use (ATEN_CPU_CAPABILITY; CPU results "
        f"change with it): one of {', '.join(CPU_CAPABILITIES)}; recorded in the run's settings. "
        "Default: whatever this CPU supports",
    )


def _add_portable(p: argparse.ArgumentParser) -> None:
    from torchrepro.portable import CBWR_DEFAULT, CBWR_VAR

    p.add_argument(
        "--portable",
        action="store_true",
        help="portable mode: results that do not change with the thread count or the CPU, as far as "
        f"measured: oneMKL's strict reproducibility ({CBWR_VAR}={CBWR_DEFAULT}), a fixed CPU instruction "
        "set (ATEN_CPU_CAPABILITY=avx2 on x86 with AVX2), oneDNN off; a valid value already in the "
        "environment is kept; recorded in the run's settings (slower: see docs/run.md)",
    )


def _add_nodes(p: argparse.ArgumentParser, *, check: bool = False) -> None:
    """torchrun's multi-node flags, spelled and meaning what they mean there (``nodes``); ``check``:
    the check on the endpoint's host leads the others (``check_nodes``)."""
    from torchrepro.nodes import BACKENDS, DEFAULT_RDZV_ID, JOIN_TIMEOUT

    g = p.add_argument_group(
        "several nodes",
        "give the same flags on every node (but --node-rank); see docs/nodes.md"
        + (
            "; the check on the --rdzv-endpoint host (--node-rank 0) leads: its flags decide every run "
            "and it prints the verdict, which every node exits with"
            if check
            else ""
        ),
    )
    g.add_argument(
        "--nnodes",
        metavar="N",
        default=None,
        help="the run's ranks span N nodes, --nproc on each (elastic MIN:MAX is refused)",
    )
    g.add_argument(
        "--node-rank",
        metavar="R",
        type=_integer(0, "a node rank"),
        default=None,
        help="this node's rank, 0 to N-1 (needed with --rdzv-backend static; c10d numbers the nodes "
        "as they join, so global rank 0 may be on any node)",
    )
    g.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        default=None,
        help="where the nodes meet: a host every node reaches and a free port, the same on every node",
    )
    g.add_argument(
        "--rdzv-backend",
        choices=BACKENDS,
        default="c10d",
        help="torchrun's rendezvous backend (default c10d)",
    )
    g.add_argument(
        "--rdzv-id",
        metavar="ID",
        default=DEFAULT_RDZV_ID,
        help=f"the job's id, the same on every node (default {DEFAULT_RDZV_ID})",
    )
    g.add_argument(
        "--join-timeout",
        metavar="S",
        type=_integer(1, "a number of seconds"),
        default=JOIN_TIMEOUT,
        help=f"seconds the nodes have to join; a node that never comes ends the run on the others "
        f"(default {JOIN_TIMEOUT})",
    )


def _nodes(args: argparse.Namespace) -> Any:
    """The ``nodes.Nodes`` the flags give (None: one node); ``SettingsError`` for bad flags."""
    from torchrepro.errors import SettingsError
    from torchrepro.nodes import DEFAULT_RDZV_ID, JOIN_TIMEOUT, Nodes, parse_nnodes

    if args.nnodes is None:
        given = [
            flag
            for flag, value, default in (
                ("--node-rank", args.node_rank, None),
                ("--rdzv-endpoint", args.rdzv_endpoint, None),
                ("--rdzv-backend", args.rdzv_backend, "c10d"),
                ("--rdzv-id", args.rdzv_id, DEFAULT_RDZV_ID),
                ("--join-timeout", args.join_timeout, JOIN_TIMEOUT),
            )
            if value != default
        ]
        if given:
            verb = "goes" if len(given) == 1 else "go"
            raise SettingsError(
                f"{', '.join(given)} {verb} with --nnodes N (the number of nodes the run spans)"
            )
        return None
    return Nodes(
        nnodes=parse_nnodes(args.nnodes),
        endpoint=args.rdzv_endpoint,
        node_rank=args.node_rank,
        backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id,
        join_timeout=args.join_timeout,
    )


def _step_list(text: str) -> tuple[int, ...]:
    """``--resume-at``: optimizer step counts >= 1, separated by commas (``2,5``)."""
    parse = _integer(1, "optimizer step counts separated by commas")
    return tuple(parse(part.strip()) for part in text.split(","))


def _arguments(text: str) -> tuple[str, ...]:
    """``--resume-args``: one string split as a shell splits it."""
    import shlex

    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"must be arguments as a shell writes them ({exc}): {text!r}"
        ) from None


def _integer(minimum: int, what: str, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum], refused with what is accepted."""
    accepted = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, {accepted}; got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {what}, {accepted}; got {value}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from torchrepro.flags import MODES
    from torchrepro.seeding import MAX_SEED

    seed_type = _integer(0, "a seed", MAX_SEED)
    threads_type = _integer(1, "a thread count")
    nproc_type = _integer(1, "a number of ranks")
    mode_help = "determinism switches: strict (deterministic kernels, errors for ops without one), "
    mode_help += "warn (the same, but those ops only warn), off (PyTorch's defaults); default strict"

    parser = _TopParser(
        prog="torchrepro",
        description="Bit-for-bit reproducible PyTorch training runs, and where and why they are not.",
        epilog="Exit codes: 0 reproducible / OK, 1 not reproducible / findings, 2 usage error or the "
        "script failed, 3 inconclusive (nothing beyond init compared on some rank); a script killed "
        "by signal N: 128+N.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"torchrepro {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("run", help="run a script with every RNG seeded and determinism switches set")
    p.add_argument("--seed", type=seed_type, default=0, help="the run's seed, 0 to 2**64-1 (default 0)")
    p.add_argument("--mode", choices=MODES, default="strict", help=mode_help)
    p.add_argument("--threads", type=threads_type, default=None, help="pin torch/OMP/MKL threads to N")
    _add_cpu_capability(p)
    _add_portable(p)
    p.add_argument(
        "--nproc", type=nproc_type, default=None, help="launch N ranks through torchrun (on each node)"
    )
    _add_nodes(p)
    p.add_argument(
        "--record",
        metavar="DIR",
        default=None,
        help="write the run record to DIR (a new or empty directory; default .torchrepro/runs/<id>)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="with --record: replace the record already in DIR (other files in it are kept)",
    )
    p.add_argument(
        "--trace-step",
        metavar="K",
        type=_integer(0, "an optimizer step index (0 is the first step)"),
        default=None,
        help="also record an op trace of optimizer step K (0-based) in the run record "
        "(one file per rank), so that `torchrepro compare` of two such runs diverging at step K "
        "names the op, module and line where they part",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout when the script ends: its exit code and the record path",
    )
    _add_script_args(p)

    p = sub.add_parser("check", help="run a script several times and report the first divergence")
    p.add_argument(
        "--runs", type=_integer(2, "a number of runs"), default=2, help="how many runs to compare (default 2)"
    )
    p.add_argument(
        "--steps",
        type=_integer(1, "a number of training steps"),
        default=None,
        help="stop every run after N training steps: optimizer steps, or backward() calls in a script "
        "that updates weights without torch.optim (default: run the script to its end)",
    )
    p.add_argument(
        "--nproc",
        type=nproc_type,
        default=None,
        help="launch N ranks per run through torchrun, on each node (--vary world: the later runs' ranks)",
    )
    _add_nodes(p, check=True)
    p.add_argument("--seed", type=seed_type, default=0, help="the runs' seed, 0 to 2**64-1 (default 0)")
    p.add_argument("--mode", choices=MODES, default="strict", help=mode_help)
    p.add_argument("--threads", type=threads_type, default=None, help="pin torch/OMP/MKL threads to N")
    _add_cpu_capability(p)
    _add_portable(p)
    p.add_argument(
        "--no-seed", action="store_true", help="run as plain python would (no seeding, no switches)"
    )
    p.add_argument(
        "--vary",
        choices=VARY_CHOICES,
        default=None,
        help="change one thing in the later runs to test that the result does not depend on it: "
        "workers (every DataLoader's num_workers), threads (1 <-> 2; with --portable: whether the "
        "results are independent of the thread count), hashseed (PYTHONHASHSEED), "
        "world (the first run on 1 process, the others on --nproc N, default 2, each through torchrun "
        "with --threads per process, default 1: rank 0 of the first run is compared with every rank "
        "of the others in the parameters given to each optimizer, every optimizer step and the state "
        "at exit, not in batches, recorded values or backward() steps, which depend on the split; "
        "for training on a fixed global batch, e.g. with torchrepro.SeededLoader(global_batch_size=...) "
        "and torchrepro.InvariantDataParallel), resume (the later run is SIGKILLed after an optimizer "
        "step, --resume-at, and started again with the same command in the files it left, and must "
        "end with the bits of the uninterrupted run: whether the script's own checkpoints resume exactly), "
        "compile (the first run eager, torch.compile turned off with TORCH_COMPILE_DISABLE=1, the "
        "later runs compiled as the script compiles, each with an empty Inductor cache of the check's "
        "own: whether compiling keeps eager's bits, where it first does not, and the largest "
        "difference per step; strict mode sets Inductor's fallback_random so compiled random ops draw "
        "as eager's do)",
    )
    p.add_argument(
        "--resume-at",
        type=_step_list,
        default=None,
        metavar="K[,K...]",
        help="with --vary resume: kill the run once optimizer step K and what the script saves after it "
        "are done (several: one killed and restarted run each; default: the middle of the first run's "
        "steps)",
    )
    p.add_argument(
        "--resume-args",
        type=_arguments,
        default=(),
        metavar='"ARGS"',
        help="with --vary resume: arguments added when the killed run is started again, one quoted "
        'string (e.g. --resume-args "--resume_from_checkpoint last")',
    )
    p.add_argument("--no-locate", action="store_true", help="do not re-run to locate a compute divergence")
    p.add_argument(
        "--repro",
        metavar="DIR",
        default=None,
        help="when the located op's inputs are equal and its outputs differ (or depend on the thread "
        "count), write a standalone script (repro.py, needs torch only) and its inputs into DIR, a new "
        "or empty directory: what to attach to a bug report",
    )
    p.add_argument(
        "--serial",
        action="store_true",
        help="run one run at a time (for a GPU that holds one run, or a script writing fixed paths "
        "outside the working directory)",
    )
    p.add_argument(
        "--no-isolate",
        action="store_true",
        help="let the runs write into the working directory side by side (default: each run writes "
        "to its own copy-on-write view of it, kept in its record; the user's files are never touched)",
    )
    p.add_argument(
        "--report",
        metavar="OUT.html",
        default=None,
        help="also write the verdict as one self-contained HTML page: a plot per step of how far the "
        "runs are apart, the first divergence with its source lines, the environment differences; the "
        f"runs go on for up to {REPORT_STEPS_AFTER} steps after a divergence so the plot shows it grow",
    )
    p.add_argument(
        "--json", action="store_true", help="print the verdict as one JSON object on stdout (with notes)"
    )
    _add_script_args(p)

    p = sub.add_parser("compare", help="compare two recorded runs")
    p.add_argument("run_a", help="a run-record directory (torchrepro run --record DIR)")
    p.add_argument("run_b", help="another run-record directory")
    p.add_argument(
        "--report",
        metavar="OUT.html",
        default=None,
        help="also write the comparison as one self-contained HTML page (a plot per step of how far "
        "the runs are apart, the first divergence with its source lines, the environment differences)",
    )
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")

    p = sub.add_parser("audit", help="find what would break determinism on CUDA, from a CPU run")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    p.add_argument(
        "--steps",
        type=_integer(1, "a number of optimizer steps"),
        default=1,
        help="optimizer steps to run before stopping the script (default 1)",
    )
    _add_script_args(p)

    p = sub.add_parser(
        "status",
        help="every determinism switch and process-start setting a script started here would get",
        description="The determinism report of a fresh process started from this shell (what a "
        "script gets before its first line): each switch, what strict mode wants, and the fix for "
        "what falls short. In a script, print(torchrepro.status()) gives the same table.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser(
        "clean",
        help="remove old run and check records from .torchrepro/",
        description="Keep the KEEP newest records of each kind (.torchrepro/runs/, .torchrepro/checks/) "
        "and remove the others. A record a run is writing, or one changed in the last minute, is "
        "never removed; anything not named like a record is left alone.",
    )
    p.add_argument(
        "--keep",
        type=_integer(0, "a number of records"),
        default=10,
        help="records kept of each kind (default 10)",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    p.add_argument("--root", default=None, help="the records directory (default .torchrepro)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("env", help="the environment fingerprint, or the diff of two")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--script", default=None, help="record this script's digest and its repository's git state"
    )
    env_sub = p.add_subparsers(dest="env_command", metavar="diff")
    d = env_sub.add_parser(
        "diff",
        help="explain the differences between two environment files",
        description="Exit 0 when nothing that can break bitwise reproducibility differs, 1 when "
        "something does, 2 when a file is unreadable or malformed. A file may be `torchrepro env "
        '--json` output, a JSON object with an "env" key, or a run-record directory.',
    )
    d.add_argument("a", help="environment JSON file or run-record directory")
    d.add_argument("b", help="environment JSON file or run-record directory")
    d.add_argument("--json", action="store_true", dest="diff_json", help="print one JSON object")

    p = sub.add_parser(
        "completion",
        help="print a shell completion script (needs shtab: pip install torchrepro[completion])",
        description="Print the completion script for SHELL on stdout; load it from the shell's "
        "start-up file, e.g. `torchrepro completion bash > ~/.torchrepro.bash` and `source` it in "
        "~/.bashrc.",
    )
    p.add_argument("shell", choices=COMPLETION_SHELLS, help="the shell to complete in")
    return parser


COMPLETION_SHELLS = ("bash", "zsh", "tcsh")


_TARGET_COMMANDS = ("run", "check", "audit")


def _split_module(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str] | None]:
    """Split ``argv`` at ``-m MODULE`` like python does: ``(torchrepro's argv, [MODULE, *its args])``.

    Everything after ``-m MODULE`` (or ``-mMODULE``) is the module's, options included. Scanning
    stops at the script (the first positional that is not an option's value) or at ``--``.
    """
    if not argv or argv[0] not in _TARGET_COMMANDS:
        return argv, None
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    takes_value = {
        option
        for action in sub.choices[argv[0]]._actions
        if action.nargs != 0 and action.dest != "module"
        for option in action.option_strings
    }
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-"):
            break
        if token == "-m":
            return (argv[:i], argv[i + 1 :]) if i + 1 < len(argv) else (argv, None)
        if token.startswith("-m") and not token.startswith("--"):
            return argv[:i], [token[2:], *argv[i + 1 :]]
        i += 2 if token in takes_value else 1
    return argv, None


def _script_target(args: argparse.Namespace) -> tuple[str | None, str | None, list[str]]:
    """(script, module, script args): with ``-m`` a positional after it is the module's argument."""
    script, rest = args.script, list(args.args)
    if args.module is not None and script is not None:
        rest.insert(0, script)
        script = None
    return script, args.module, rest


def _cmd_run(args: argparse.Namespace) -> int:
    import json

    from torchrepro.launch import launch

    script, module, rest = _script_target(args)
    result = launch(
        script,
        rest,
        module=module,
        seed=args.seed,
        mode=args.mode,
        threads=args.threads,
        cpu_capability=args.cpu_capability,
        portable=args.portable,
        nproc=args.nproc,
        nodes=_nodes(args),
        record_dir=args.record,
        overwrite=args.overwrite,
        trace_step=args.trace_step,
    )
    code = result.exit_code
    if args.json:
        print(json.dumps({"exit_code": code, "record": result.record_dir}))
    for note in result.notes:
        print(f"torchrepro run: {note}", file=sys.stderr)
    print(f"torchrepro run: exit code {code}; record in {result.record_dir}", file=sys.stderr)
    return code


def _cmd_check(args: argparse.Namespace) -> int:
    import json

    from torchrepro.check import CheckProgress, check_script

    script, module, rest = _script_target(args)
    if args.report is not None:
        from torchrepro.report import check_report_path

        check_report_path(args.report)  # a path it may not write is refused before the runs start
    tty = sys.stderr.isatty()
    last_line_at = [-1e9]

    def progress(p: CheckProgress) -> None:
        if p.phase == "locating":
            line = "locating the first differing op..."
        else:
            total = f"/{args.steps}" if args.steps is not None else ""  # a total only when it is known
            line = "steps " + " | ".join(f"run {i + 1}: {s}{total}" for i, s in enumerate(p.steps))
            if not tty:  # a log, not a live line: one progress line every few seconds is plenty
                now = time.monotonic()
                if now - last_line_at[0] < 5.0:
                    return
                last_line_at[0] = now
        print(("\r" + line + "\033[K") if tty else line, file=sys.stderr, end="" if tty else "\n", flush=True)

    result = check_script(script, rest, module=module, options=check_options(args), progress=progress)
    if tty:
        print(file=sys.stderr)
    verdict = result.to_dict()
    if args.report is not None and result.leader is not None:
        print(
            f"torchrepro check: no report here: the records are on {result.leader}, which writes the "
            "report when its check was given --report",
            file=sys.stderr,
        )
    elif args.report is not None:
        from torchrepro.report import write_check_report

        print(f"torchrepro check: report in {write_check_report(args.report, result)}", file=sys.stderr)
    if result.error is not None:
        # runs that wrote the same paths outside the isolation failed because of each other: the
        # error names them and the ways out, and is not called a failure of the script
        failed = "" if result.shared_writes or result.node_failed else "the script failed: "
        print(f"torchrepro check: {failed}{result.error}", file=sys.stderr)
        if result.stderr_tail:
            print(result.stderr_tail, file=sys.stderr)
    for note in result.notes:
        print(f"torchrepro check: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(verdict, allow_nan=False))
    elif result.error is None:
        print("\n".join(describe_check(result)))
    where = "" if result.leader is None else f"{result.leader}, "
    print(f"torchrepro check: records in {where}{result.check_dir}", file=sys.stderr)
    return result.outcome.exit_code


def check_options(args: argparse.Namespace) -> CheckOptions:
    """The ``CheckOptions`` of ``torchrepro check``'s parsed flags: a flag sets the field of its name,
    ``--no-X`` clears ``X``, and ``--report`` asks for the steps after a divergence and, under
    ``--vary threads``, the located op under both thread counts (the page shows them)."""
    same = {name: getattr(args, name) for name in CheckOptions.fields() if name in CHECK_FLAGS}
    report = args.report is not None
    return CheckOptions(
        **same,
        nodes=_nodes(args),
        locate=not args.no_locate,
        isolate=not args.no_isolate,
        steps_after_divergence=REPORT_STEPS_AFTER if report else 0,
        repro_threads=report,
    )


CHECK_FLAGS = (
    "runs",
    "steps",
    "nproc",
    "seed",
    "mode",
    "threads",
    "cpu_capability",
    "no_seed",
    "vary",
    "portable",
    "serial",
    "repro",
    "resume_at",
    "resume_args",
)
"""``CheckOptions`` fields that a ``torchrepro check`` flag of the same name sets as it is."""


def _cmd_compare(args: argparse.Namespace) -> int:
    import json

    from torchrepro.compare import compare_runs

    if args.report is not None:
        from torchrepro.report import check_report_path

        check_report_path(args.report)
    result = compare_runs(args.run_a, args.run_b)
    data = result.to_dict()
    if args.report is not None:
        from torchrepro.report import write_compare_report

        written = write_compare_report(args.report, result, args.run_a, args.run_b)
        print(f"torchrepro compare: report in {written}", file=sys.stderr)
    if args.json:
        print(json.dumps(data, allow_nan=False))
    else:
        lines = describe_comparison(result)
        print("\n".join(lines[:-1] if result.coverage is not None else lines))
        _render_env_differences(data["env_differences"])
        if result.coverage is not None:
            print(lines[-1])
    return result.outcome.exit_code


def _render_env_differences(differences: list[dict[str, Any]]) -> None:
    """``compare``'s environment lines: each difference that can break reproducibility (``!``);
    those a setting difference above set, and the harmless ones, named in one line each; the
    ones every pair of records has (when and where each was recorded) left out."""
    shown = [d for d in differences if not d.get("volatile")]
    explained = [d for d in shown if d.get("setting")]
    breaking = [d for d in shown if d.get("breaks") and not d.get("setting")]
    harmless = [d for d in shown if not d.get("breaks") and not d.get("setting")]
    for d in breaking:
        print(f" ! env {d.get('key')}: {d.get('a')!r} vs {d.get('b')!r}  ({d.get('reason')})")
    if explained:
        by_setting: dict[str, list[str]] = {}
        for d in explained:
            by_setting.setdefault(str(d.get("setting")), []).append(str(d.get("key")))
        for setting, keys in by_setting.items():
            print(f"   env set by the {setting} setting above: {', '.join(keys)}")
    if harmless:
        names = ", ".join(str(d.get("key")) for d in harmless)
        print(f"   harmless env differences: {names} (`torchrepro env diff` explains each)")
    if not shown:
        print("  environments: no difference recorded")
    elif breaking:
        print(f"  {len(breaking)} environment difference(s) can break bitwise reproducibility (!)")


def _render_audit(report: AuditReport) -> str:
    import textwrap

    steps = report.optimizer_steps
    seen = f"{steps if steps is not None else '?'} optimizer step(s)"
    if report.backward_steps:
        seen += f", {report.backward_steps} backward() step(s) no optimizer saw"
    children = [p for p in report.processes if not p.get("main")]
    if children:
        trained = report.training_processes
        seen += f" in {trained} of {len(report.processes)} processes" if trained > 1 else ""
        seen += f"; {len(children)} child process(es)"
        unfollowed = sum(1 for p in children if not p.get("followed", True))
        seen += f", {unfollowed} not followed" if unfollowed else ""
    lines = [
        f"torchrepro audit: {report.script} ({seen}, "
        f"{report.ops_recorded} ops recorded, op table for torch {report.table_release})"
    ]
    for f in report.findings:
        where = "  ".join(x for x in (f.location, f.module, f.op) if x) or "(settings)"
        lines.append(f"{f.severity.upper():8}{f.code}  {where}")
        lines += textwrap.wrap(f.message, 104, initial_indent=" " * 8, subsequent_indent=" " * 8)
        lines += textwrap.wrap("fix: " + f.fix, 104, initial_indent=" " * 8, subsequent_indent=" " * 13)
    counts = {s: sum(f.severity == s for f in report.findings) for s in ("error", "warning", "info")}
    lines.append(f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info")
    return "\n".join(lines)


def _cmd_audit(args: argparse.Namespace) -> int:
    import json

    from torchrepro.audit import audit_script

    script, module, rest = _script_target(args)
    target = module if module is not None else script
    assert target is not None
    report = audit_script(target, rest, steps=args.steps, module=module is not None)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(_render_audit(report))
    return EXIT_FINDINGS if report.errors else EXIT_OK


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from torchrepro.status_report import status

    report = status()
    print(json.dumps(report.to_dict(), indent=2) if args.json else str(report))
    return EXIT_OK


def _cmd_clean(args: argparse.Namespace) -> int:
    import json

    from torchrepro.runrecord import RECORDS_ROOT, clean_records

    report = clean_records(args.root or RECORDS_ROOT, keep=args.keep, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for path in report.removed:
        print(f"{verb} {path}")
    for path in report.in_use:
        print(f"kept {path} (in use, or changed in the last minute)")
    left = len(report.kept) + len(report.in_use)
    print(f"torchrepro clean: {verb} {len(report.removed)} record(s), kept {left}")
    return EXIT_OK


def _cmd_env(args: argparse.Namespace) -> int:
    import json

    from torchrepro.env import collect_env, diff_env, load_env

    as_json = bool(args.json or getattr(args, "diff_json", False))
    if args.env_command != "diff":
        env = collect_env(script=args.script).to_dict()
        print(json.dumps(env, indent=2) if as_json else _render_env(env))
        return EXIT_OK
    differences = diff_env(load_env(args.a), load_env(args.b))
    breaks = any(d.breaks for d in differences)
    if as_json:
        out = {"a": args.a, "b": args.b, "breaks": breaks, "differences": [d.to_dict() for d in differences]}
        print(json.dumps(out, indent=2))
    else:
        print(_render_env_diff(args.a, args.b, differences))
    return EXIT_FINDINGS if breaks else EXIT_OK


def _short(value: object, width: int = 90, *, none: str = "null") -> str:
    import json

    text = none if value is None else value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _render_env(env: dict[str, object]) -> str:
    """``env`` as an aligned two-column table; nested values indented below their field."""
    lines = ["torchrepro environment (null = could not be collected)"]
    for key, value in env.items():
        if isinstance(value, dict) and value:
            lines.append(f"  {key}:")
            width = max(len(str(k)) for k in value)
            none = "<unset>" if key == "env_vars" else "null"
            lines += [f"    {k:<{width}}  {_short(v, none=none)}" for k, v in value.items()]
        elif key == "gpus" and isinstance(value, list) and value:
            lines.append(f"  {key}:")
            lines += [f"    [{i}] {_short(g)}" for i, g in enumerate(value)]
        else:
            shown = " ".join(value) if key == "cpu_flags" and isinstance(value, list) else value
            lines.append(f"  {key:<22}  {_short(shown)}")
    return "\n".join(lines)


def _none(key: str) -> str:
    return "<unset>" if key.startswith("env_vars.") else "null"


def _render_env_diff(a: str, b: str, differences: Sequence[EnvDifference]) -> str:
    """The differences grouped by class: first what can break bitwise reproducibility."""
    if not differences:
        return f"environments {a} and {b}: no difference"
    lines = [f"environments A={a} and B={b}: {len(differences)} difference(s)"]
    for breaks, title in ((True, "can break bitwise reproducibility"), (False, "harmless")):
        group = [d for d in differences if d.breaks == breaks]
        if not group:
            continue
        lines.append(f"{title} ({len(group)}):")
        for reason in dict.fromkeys(d.reason for d in group):
            lines.append(f"  {'!' if breaks else '-'} {reason}")
            lines += [
                f"      {d.key}: {_short(d.a, 50, none=_none(d.key))} -> {_short(d.b, 50, none=_none(d.key))}"
                for d in group
                if d.reason == reason
            ]
    verdict = (
        "something that matters differs" if any(d.breaks for d in differences) else "nothing that matters"
    )
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)


def _cmd_completion(args: argparse.Namespace) -> int:
    """The completion script shtab writes from this parser (shtab is imported only here)."""
    try:
        import shtab
    except ImportError:
        print(
            "torchrepro completion: error: shell completion needs the shtab package; install it "
            "with `pip install torchrepro[completion]`",
            file=sys.stderr,
        )
        return EXIT_USAGE
    parser = build_parser()
    for action in _all_actions(parser):  # scripts and record directories complete as paths
        if action.dest in ("script", "run_a", "run_b", "a", "b", "record", "root"):
            action.complete = shtab.FILE  # type: ignore[attr-defined]
    print(shtab.complete(parser, shell=args.shell), end="")
    return EXIT_OK


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every action of ``parser`` and of its subparsers, at any depth."""
    found: list[argparse.Action] = []
    for action in parser._actions:
        found.append(action)
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += _all_actions(child)
    return found


_COMMANDS = {
    "run": _cmd_run,
    "check": _cmd_check,
    "compare": _cmd_compare,
    "audit": _cmd_audit,
    "env": _cmd_env,
    "status": _cmd_status,
    "clean": _cmd_clean,
    "completion": _cmd_completion,
}


def _own_args(raw: list[str]) -> list[str]:
    """torchrepro's own arguments: those before the script (or ``-m MODULE``) and its arguments."""
    for i, arg in enumerate(raw):
        if arg == "-m" or arg.endswith(".py"):
            return raw[:i]
    return raw


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchrepro`` console script; returns the exit code."""
    global _usage_error
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    _usage_error = None
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a usage error (2), already printed
        code = exc.code if isinstance(exc.code, int) else EXIT_USAGE
        if code == EXIT_USAGE and _usage_error is not None and "--json" in _own_args(raw):
            _json_error(next((a for a in raw if not a.startswith("-")), None), _usage_error, "usage")
        return code
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command in _TARGET_COMMANDS and args.module is None and args.script is None:
        print(
            f"torchrepro {args.command}: error: give a script (or -m MODULE) to {args.command} "
            f"(see `torchrepro {args.command} --help`)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        return _COMMANDS[args.command](args)
    except ReproError as exc:
        print(f"torchrepro {args.command}: error: {exc}", file=sys.stderr)
        if getattr(args, "json", False):
            _json_error(args.command, str(exc), "error")
        return EXIT_USAGE
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (launch.Terminated)
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"torchrepro {args.command}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
