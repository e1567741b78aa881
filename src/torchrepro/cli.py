"""The ``torchrepro`` command line: parse, call one library function, render, exit code.

Exit codes everywhere: 0 = reproducible / OK, 1 = not reproducible / findings, 2 = usage error
or the script itself failed. With ``--json`` stdout holds exactly one JSON object; progress
and messages go to stderr. The library never prints; only this module does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torchrepro

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2


def _add_script_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    p.add_argument("script", nargs="?", help="the training script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="torchrepro",
        description="Bit-for-bit reproducible PyTorch training runs, and where and why they are not.",
    )
    parser.add_argument("--version", action="version", version=f"torchrepro {torchrepro.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="run a script with every RNG seeded and determinism switches set")
    p.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    p.add_argument("--mode", choices=["strict", "warn", "off"], default="strict")
    p.add_argument("--threads", type=int, default=None, help="pin torch/OMP/MKL threads to N")
    p.add_argument("--nproc", type=int, default=None, help="launch N ranks through torchrun")
    p.add_argument("--record", metavar="DIR", default=None, help="write the run record to DIR")
    _add_script_args(p)

    p = sub.add_parser("check", help="run a script several times and report the first divergence")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="stop every run after N optimizer steps")
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=["strict", "warn", "off"], default="strict")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-seed", action="store_true", help="run as plain python would")
    p.add_argument("--vary", choices=["workers", "threads", "hashseed"], default=None)
    p.add_argument("--json", action="store_true")
    _add_script_args(p)

    p = sub.add_parser("compare", help="compare two recorded runs")
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("audit", help="find what would break determinism on CUDA, from a CPU run")
    p.add_argument("--json", action="store_true")
    p.add_argument("--steps", type=int, default=1)
    _add_script_args(p)

    p = sub.add_parser("env", help="the environment fingerprint, or the diff of two")
    p.add_argument("--json", action="store_true")
    env_sub = p.add_subparsers(dest="env_command", metavar="diff")
    d = env_sub.add_parser("diff", help="explain the differences between two environment files")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--json", action="store_true", dest="diff_json")
    return parser


def _not_ready(args: argparse.Namespace) -> int:
    print(f"torchrepro {args.command}: not available in this build yet", file=sys.stderr)
    return EXIT_USAGE


def _cmd_run(args: argparse.Namespace) -> int:
    return _not_ready(args)


def _cmd_check(args: argparse.Namespace) -> int:
    return _not_ready(args)


def _cmd_compare(args: argparse.Namespace) -> int:
    return _not_ready(args)


def _cmd_audit(args: argparse.Namespace) -> int:
    return _not_ready(args)


def _cmd_env(args: argparse.Namespace) -> int:
    return _not_ready(args)


_COMMANDS = {
    "run": _cmd_run,
    "check": _cmd_check,
    "compare": _cmd_compare,
    "audit": _cmd_audit,
    "env": _cmd_env,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchrepro`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return _COMMANDS[args.command](args)
    except torchrepro.ReproError as exc:
        print(f"torchrepro {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"torchrepro {args.command}: interrupted", file=sys.stderr)
        return 130
