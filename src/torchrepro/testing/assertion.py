"""``assert_reproducible``: a check as a test assertion, and ``Checker``, what the pytest fixture gives.

Invariants:
- Built on ``check.check_script`` (what ``torchrepro check`` calls). A pass is a conclusive
  "reproducible" verdict and nothing else: a divergence, an inconclusive verdict (nothing that
  changes during training was compared, ``vary`` varied nothing) and a run that failed each raise
  ``ReproAssertionError``, whose message is the verdict as ``torchrepro check`` prints it
  (``verdict.describe_check``), its notes, and where the records are.
- A target is a script path, ``"-m package.module"`` (a module run as ``python -m`` runs it), or
  a module-level function, run through a generated runner script (``testing.runner``); a
  function's arguments travel as JSON, a script's as its command line (``str()`` of each).
- ``vary`` given as several values makes one check per value, in order, stopping at the first
  that fails; each check compares ``runs`` fresh runs. A dict varies a function's keyword
  arguments: the later runs call it with them (``check_script(later_args=)``).
- No torch in this process (a check's parent imports none).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, overload

from torchrepro.check import check_script
from torchrepro.errors import ReproAssertionError
from torchrepro.options import ASSERT_OPTIONS, CheckOptions
from torchrepro.results import CheckResult, Outcome
from torchrepro.testing.runner import LATER, RUNNER_NAME, FunctionCall, function_call, write_runner
from torchrepro.verdict import describe_check

__all__ = ["CHECK_OPTIONS", "Checker", "assert_reproducible", "check_call", "failure_message"]

CHECK_OPTIONS = ASSERT_OPTIONS
"""The keyword options of ``assert_reproducible`` beyond ``steps``, ``vary`` and ``runs``: fields of
``CheckOptions`` (``torchrepro check``'s options), passed through unchanged."""

Target = str | os.PathLike[str] | Callable[..., Any]
"""A script path, ``"-m package.module"``, or a module-level function."""

Variation = str | Mapping[str, Any] | None
"""What the later runs of one check change: nothing, a setting (``"threads"``, ``"workers"``,
``"hashseed"``, ``"world"``; ``"resume"``: killed after a step and started again, with the options
``resume_at`` and ``resume_args``), or, for a function, keyword arguments it is called with
(``{"resume_at": 3}``)."""
Variations = list[Variation] | tuple[Variation, ...]
"""Several variations: one check each, in order."""

_MODULE = re.compile(r"-m\s+([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\s*")


@dataclass(frozen=True)
class _Launch:
    """What a check starts: a script or a module with its command line, or a function call."""

    name: str
    script: str | None = None
    module: str | None = None
    argv: tuple[str, ...] = ()
    call: FunctionCall | None = None


def _launch(target: Target, args: Sequence[Any]) -> _Launch:
    if isinstance(target, (str, os.PathLike)):
        text = os.fspath(target)
        argv = tuple(_argument(a, i) for i, a in enumerate(args))
        if text.startswith("-m"):
            match = _MODULE.fullmatch(text)
            if match is None:
                raise ValueError(
                    "a module target is '-m package.module' (its arguments go after it, as *args), "
                    f"got {text!r}"
                )
            return _Launch(name=f"-m {match.group(1)}", module=match.group(1), argv=argv)
        return _Launch(name=text, script=text, argv=argv)
    call = function_call(target, args)
    return _Launch(name=call.describe(), call=call)


def _argument(value: Any, index: int) -> str:
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise TypeError(
        f"argument {index + 1} of a script or module target is its command line: a string, a path or a "
        f"number, got {type(value).__name__} {value!r}"
    )


_RESUME_OPTIONS = ("resume_at", "resume_args")
"""Options of ``vary="resume"`` only: given to its check, not to the others of a list of ``vary``."""


def _varies(vary: Variation | Variations, launch: _Launch) -> list[Variation]:
    varies: list[Variation] = list(vary) if isinstance(vary, (list, tuple)) else [vary]
    if not varies or not all(isinstance(v, (str, Mapping)) for v in varies if v is not None):
        raise ValueError(
            f"vary must be None, a setting's name, a dict of keyword arguments or a non-empty sequence of "
            f"them, got {vary!r}"
        )
    if launch.call is None and any(isinstance(v, Mapping) for v in varies):
        raise TypeError(
            "vary as a dict compares a function called with those keyword arguments against the plain "
            f"call; {launch.name} is a script or module: vary its settings (threads, workers, hashseed, "
            "world, resume) instead"
        )
    return varies


def _variant_text(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in kwargs.items()) + " in the later runs"


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(CHECK_OPTIONS))
    if unknown:
        raise TypeError(
            f"assert_reproducible got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: its "
            f"options are steps, vary, runs and those of torchrepro check: {', '.join(CHECK_OPTIONS)} (a "
            "function's own arguments are positional)"
        )
    return dict(options)


def failure_message(name: str, vary: Variation, result: CheckResult) -> str:
    """The message of a failed ``assert_reproducible``: the verdict, its notes, the records."""
    who = name + (f" (vary={vary!r})" if vary is not None else "")
    if result.outcome is Outcome.FAILED:
        failed = "" if result.shared_writes else "the training failed: "
        lines = [f"{who}: {failed}{result.error}"]
        if result.stderr_tail:
            lines.append("  the failed run's output ended with:")
            lines += [f"    {line}" for line in result.stderr_tail.splitlines()]
    else:
        head, *rest = describe_check(result)
        lines = [f"{who}: {head}", *rest]
        if result.outcome is Outcome.INCONCLUSIVE:
            lines.append("  an inconclusive check fails: a pass needs training compared and found identical")
    lines += [f"  note: {note}" for note in result.notes]
    lines.append(f"  records: {result.check_dir}")
    return "\n".join(lines)


def _run(
    launch: _Launch,
    *,
    steps: int | None,
    vary: Variation | Variations,
    runs: int,
    options: Mapping[str, Any],
    workdir: Path | None,
) -> tuple[CheckResult, ...]:
    __tracebackhide__ = True  # a failing test shows the user's call, then the verdict
    varies = _varies(vary, launch)
    check_options = _options(options)
    if workdir is not None:
        check_options.setdefault("root", workdir / "checks")
    resume = {key: check_options.pop(key) for key in _RESUME_OPTIONS if key in check_options}
    if resume and "resume" not in varies:
        raise TypeError(f"{' and '.join(resume)} go with vary='resume' (got vary={vary!r})")
    base = CheckOptions.build(runs=runs, steps=steps, **check_options)
    results: list[CheckResult] = []
    with ExitStack() as stack:
        directory = "."
        if launch.call is not None:
            if workdir is not None:
                workdir.mkdir(parents=True, exist_ok=True)
            directory = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="torchrepro-runner-", dir=workdir)
            )
        for index, v in enumerate(varies):
            script, later = launch.script, None
            if launch.call is not None:
                call = launch.call.with_later(v) if isinstance(v, Mapping) else launch.call
                name = RUNNER_NAME if index == 0 else RUNNER_NAME.replace(".py", f"{index}.py")
                script = os.fspath(write_runner(directory, call, name=name))
                later = [LATER] if isinstance(v, Mapping) else None
            result = check_script(
                script,
                launch.argv,
                module=launch.module,
                options=base.replace(
                    vary=None if isinstance(v, Mapping) else v, **(resume if v == "resume" else {})
                ),
                later_args=later,
            )
            if isinstance(v, Mapping):
                result = replace(result, varied=_variant_text(v))
            results.append(result)
            if not result.outcome.passed:
                raise ReproAssertionError(
                    failure_message(launch.name, v, result),
                    target=launch.name,
                    results=tuple(results),
                    varied=tuple(varies[: len(results)]),
                )
    return tuple(results)


@overload
def assert_reproducible(
    target: Target,
    *args: Any,
    steps: int | None = None,
    vary: Variation = None,
    runs: int = 2,
    **options: Any,
) -> CheckResult: ...


@overload
def assert_reproducible(
    target: Target,
    *args: Any,
    steps: int | None = None,
    vary: Variations,
    runs: int = 2,
    **options: Any,
) -> tuple[CheckResult, ...]: ...


def assert_reproducible(
    target: Target,
    *args: Any,
    steps: int | None = None,
    vary: Variation | Variations = None,
    runs: int = 2,
    **options: Any,
) -> CheckResult | tuple[CheckResult, ...]:
    """Run ``target`` ``runs`` times in fresh processes and raise unless every run is identical.

    ``target`` is a script path (``args``: its command line), ``"-m package.module"`` (likewise),
    or a module-level function (``args``: its positional arguments, JSON values or paths), which
    a generated runner script imports and calls, so global state and process-start settings
    (``PYTHONHASHSEED``, the thread count) are as real as a script's; a lambda or a closure is a
    ``TypeError``. ``steps`` stops each run after that many training steps; ``vary`` changes a
    setting in the later runs (``"threads"``, ``"workers"``, ``"hashseed"``, ``"world"``,
    ``"resume"``: killed after step ``resume_at`` and started again) or, for a function, the keyword arguments they call it with (``{"resume_at": 3}``: a run resumed
    midway must train the bits of one that was not); a list of them makes one check each.
    ``options`` are ``torchrepro check``'s: ``seed`` (0), ``mode`` (``"strict"``), ``no_seed``,
    ``threads``, ``nproc``, ``cpu_capability``, ``portable``, ``serial``, ``isolate``
    (True), ``locate`` (True) and ``root``, where the records go (``.torchrepro/checks``).

    Raises ``ReproAssertionError`` (an ``AssertionError``) whose message is the verdict: the step,
    what differs, the op and line, what was compared. Inconclusive is a failure with its reason.
    Returns the verdict (a tuple of them when ``vary`` names several settings).

    >>> assert_reproducible(lambda: None)
    Traceback (most recent call last):
    ...
    TypeError: torchrepro.testing.assertion.<lambda> is a lambda: a check runs the function in fresh processes, which import it by its module and name, and it has none; define it at module level
    """  # noqa: E501
    __tracebackhide__ = True
    launch = _launch(target, args)
    results = _run(launch, steps=steps, vary=vary, runs=runs, options=options, workdir=None)
    return results if isinstance(vary, (list, tuple)) else results[0]


def check_call(
    call: FunctionCall,
    *,
    name: str | None = None,
    steps: int | None = None,
    vary: Variation | Variations = None,
    runs: int = 2,
    workdir: Path | None = None,
    **options: Any,
) -> tuple[CheckResult, ...]:
    """``assert_reproducible`` of a prepared call (the pytest marker's: keyword arguments, methods);
    ``name`` is what the message calls it (the call itself by default)."""
    __tracebackhide__ = True
    return _run(
        _Launch(name=name or call.describe(), call=call),
        steps=steps,
        vary=vary,
        runs=runs,
        options=options,
        workdir=workdir,
    )


class Checker:
    """What the ``torchrepro`` pytest fixture gives a test: ``assert_reproducible`` with the check
    records (``<directory>/checks``) and function runners in the test's temporary directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    @overload
    def assert_reproducible(
        self,
        target: Target,
        *args: Any,
        steps: int | None = None,
        vary: Variation = None,
        runs: int = 2,
        **options: Any,
    ) -> CheckResult: ...

    @overload
    def assert_reproducible(
        self,
        target: Target,
        *args: Any,
        steps: int | None = None,
        vary: Variations,
        runs: int = 2,
        **options: Any,
    ) -> tuple[CheckResult, ...]: ...

    def assert_reproducible(
        self,
        target: Target,
        *args: Any,
        steps: int | None = None,
        vary: Variation | Variations = None,
        runs: int = 2,
        **options: Any,
    ) -> CheckResult | tuple[CheckResult, ...]:
        """``torchrepro.testing.assert_reproducible``, its records below this test's directory."""
        __tracebackhide__ = True
        launch = _launch(target, args)
        results = _run(launch, steps=steps, vary=vary, runs=runs, options=options, workdir=self.directory)
        return results if isinstance(vary, (list, tuple)) else results[0]

    def __repr__(self) -> str:
        return f"Checker({os.fspath(self.directory)!r})"
