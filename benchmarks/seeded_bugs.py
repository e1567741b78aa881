"""Claim: ``torchrepro.testing.assert_reproducible`` fails on every seeded bug below and passes every
clean twin, at a few plain runs' cost.

Run: ``python benchmarks/seeded_bugs.py [--cases a,b] [--no-plain] [--no-locate]``.

Each case is a small training script in ``benchmarks/seeded_bugs/``: ``<case>_bug.py`` holds the
bug, ``<case>_clean.py`` its fix and nothing else. Both are checked the same way (the case's
``vary`` and options); a bug counts as caught when the assertion fails, a twin as clean when it
passes. Side by side in one run, per script: the wall time of the assertion (two runs started
together, compared live, a divergence located by traced re-runs unless ``--no-locate``) and of
two plain runs of the same script one after the other, as a person compares two runs by hand
(``python script.py`` twice; for a function target its runner script, once plain and once as
the variant). Exit code 1 when a bug
is missed or a twin fails.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES_DIR = ROOT / "benchmarks" / "seeded_bugs"


@dataclass(frozen=True)
class Case:
    """A seeded bug and how a test would check for it: ``vary`` and ``options`` of
    ``assert_reproducible``; ``function``: the case's module is checked through this function
    (``vary`` a dict: the later runs call it with those keyword arguments)."""

    name: str
    what: str
    vary: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    function: str | None = None


CASES = [
    Case("unseeded_transform", "an unseeded NumPy Generator in a dataset transform"),
    Case("clock_seed", "torch seeded from the clock"),
    Case("class_order", "class ids from iterating a set (order follows PYTHONHASHSEED)", vary="hashseed"),
    Case(
        "nondeterministic_op",
        "index_put_ with duplicate ids: CPU threads race (plain python, 2 threads)",
        options={"no_seed": True, "threads": 2},
    ),
    Case("thread_count", "a LayerNorm backward split by the thread count", vary="threads"),
    Case("worker_augmentation", "augmentation seeded per DataLoader worker", vary="workers"),
    Case(
        "resume_zero_grad",
        "a forgotten optimizer.zero_grad() that only matters after a resume",
        vary={"resume_at": 3},
        function="train",
    ),
]


@dataclass
class Outcome:
    case: Case
    kind: str  # "bug" or "clean"
    failed: bool  # the assertion raised
    headline: str
    check_s: float
    plain_s: float | None


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TORCHREPRO_")}


def _plain_pair(commands: list[list[str]], cwd: Path) -> float:
    """Wall time of ``commands`` (two plain runs), one after the other, as a person compares two runs."""
    start = time.perf_counter()
    for command in commands:
        done = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return time.perf_counter() - start


def _target(case: Case, kind: str, workdir: Path) -> tuple[Any, Callable[[], list[list[str]]]]:
    """What ``assert_reproducible`` gets for ``case``'s ``kind`` script, and the plain runs' argv."""
    from torchrepro.testing.runner import LATER, function_call, write_runner

    script = f"{case.name}_{kind}.py"
    if case.function is None:
        return script, lambda: [[sys.executable, script]] * 2
    function = getattr(importlib.import_module(f"{case.name}_{kind}"), case.function)

    def plain() -> list[list[str]]:
        call = function_call(function)
        later = [LATER] if isinstance(case.vary, dict) else []
        if later:
            call = call.with_later(case.vary)
        runner = str(write_runner(workdir, call, name=f"plain_{case.name}_{kind}.py"))
        return [[sys.executable, runner], [sys.executable, runner, *later]]

    return function, plain


def run_case(case: Case, kind: str, workdir: Path, *, plain: bool, locate: bool) -> Outcome:
    from torchrepro.errors import ReproAssertionError
    from torchrepro.testing import assert_reproducible
    from torchrepro.verdict import describe_check

    target, plain_commands = _target(case, kind, workdir)
    options = {**case.options, "root": workdir / "checks", "locate": locate}
    start = time.perf_counter()
    try:
        result = assert_reproducible(target, vary=case.vary, **options)
        failed, headline = False, f"passed: {result.steps_compared} steps compared"
    except ReproAssertionError as exc:
        last = exc.results[-1]
        failed, headline = True, describe_check(last)[0] if last.error is None else f"failed: {last.error}"
    check_s = time.perf_counter() - start
    plain_s = _plain_pair(plain_commands(), workdir) if plain else None
    return Outcome(case, kind, failed, headline, check_s, plain_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--no-plain", action="store_true", help="skip the two plain runs of each script")
    parser.add_argument(
        "--no-locate", action="store_true", help="do not locate a divergence by traced re-runs"
    )
    args = parser.parse_args()
    cases = CASES
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - {c.name for c in CASES})
        if unknown:
            parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(c.name for c in CASES)}")
        cases = [c for c in CASES if c.name in wanted]
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="seeded-bugs-") as tmp:
        workdir = Path(tmp)
        for path in CASES_DIR.glob("*.py"):
            shutil.copy(path, workdir / path.name)
        os.chdir(workdir)  # the checks' working directory: records and verdicts name the scripts relatively
        sys.path.insert(0, tmp)  # function targets import their case module from here
        for case in cases:
            for kind in ("bug", "clean"):
                outcome = run_case(case, kind, workdir, plain=not args.no_plain, locate=not args.no_locate)
                outcomes.append(outcome)
                verdict = (
                    ("CAUGHT" if outcome.failed else "MISSED")
                    if kind == "bug"
                    else ("passed" if not outcome.failed else "FAILED")
                )
                plain = f"{outcome.plain_s:6.1f} s" if outcome.plain_s is not None else "     -  "
                vary = f"vary={case.vary!r}" if case.vary is not None else "plain check"
                timing = f"check {outcome.check_s:6.1f} s  2 plain runs {plain}"
                print(f"{case.name:20} {kind:5} {verdict:6}  {timing}  ({vary})", flush=True)
                if kind == "bug":
                    print(f"{'':27}{outcome.headline}", flush=True)
    bugs = [o for o in outcomes if o.kind == "bug"]
    clean = [o for o in outcomes if o.kind == "clean"]
    caught = sum(o.failed for o in bugs)
    passed = sum(not o.failed for o in clean)
    check_total = sum(o.check_s for o in outcomes)
    print(f"\nseeded bugs caught: {caught}/{len(bugs)}; clean twins passed: {passed}/{len(clean)}")
    if not args.no_plain:
        plain_total = sum(o.plain_s or 0.0 for o in outcomes)
        print(
            f"time: checks {check_total:.1f} s, two plain runs of each script {plain_total:.1f} s "
            f"(ratio {check_total / plain_total:.2f}x)"
        )
    else:
        print(f"time: checks {check_total:.1f} s")
    return 0 if caught == len(bugs) and passed == len(clean) else 1


if __name__ == "__main__":
    sys.exit(main())
