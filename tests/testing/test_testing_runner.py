"""A function as a runner script: which functions and arguments can go to a fresh process, and the
script calling it there (standalone, without torchrepro)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torchrepro.testing.runner import LATER, function_call, write_runner


def write_call(path: str, *values: Any, **named: Any) -> None:
    """The function the runner calls: writes what it was given, and the types."""
    Path(path).write_text(
        json.dumps({"args": [repr(v) for v in values], "named": {k: repr(v) for k, v in named.items()}})
    )


class Suite:
    def test_method(self, path: str) -> None:
        Path(path).write_text(type(self).__name__)

    @staticmethod
    def helper(path: str) -> None:
        Path(path).write_text("static")


def _run(runner: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    # no PYTHONPATH, another directory: the runner finds the function's module on its own
    return subprocess.run(
        [sys.executable, "-I", str(runner)], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_the_runner_calls_the_function_with_its_arguments_in_a_fresh_process(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    call = function_call(write_call, [str(out), 1.5, [1, "a", None], {"k": True}], {"where": tmp_path})
    assert call.describe().startswith("test_testing_runner.write_call(")
    runner = write_runner(tmp_path, call)
    proc = _run(runner, cwd=Path("/"))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["args"] == ["1.5", "[1, 'a', None]", "{'k': True}"]
    assert got["named"] == {"where": repr(Path(tmp_path))}  # a path arrives as a pathlib.Path
    body = runner.read_text().split("\n", 2)[2]  # standalone: no torchrepro import (a path may name it)
    assert not [
        line
        for line in body.splitlines()
        if line.strip().startswith(("import torchrepro", "from torchrepro"))
    ]


def test_the_later_runs_variant_adds_its_keyword_arguments(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    call = function_call(write_call, [str(out)], {"a": 1}).with_later({"resume_at": 3, "where": tmp_path})
    runner = write_runner(tmp_path, call)
    assert _run(runner, cwd=tmp_path).returncode == 0
    assert json.loads(out.read_text())["named"] == {"a": "1"}  # plain: the call itself
    proc = subprocess.run(
        [sys.executable, "-I", str(runner), LATER], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["named"] == {"a": "1", "resume_at": "3", "where": repr(tmp_path)}
    with pytest.raises(TypeError, match="a variant of a call is a non-empty dict"):
        call.with_later({})


def test_a_test_method_is_called_on_a_new_instance_and_a_static_method_plainly(tmp_path: Path) -> None:
    method = tmp_path / "method"
    proc = _run(
        write_runner(tmp_path, function_call(Suite.test_method, [str(method)], methods=True)), tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert method.read_text() == "Suite"
    static = tmp_path / "static"
    proc = _run(write_runner(tmp_path, function_call(Suite.helper, [str(static)])), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert static.read_text() == "static"


def _make_closure() -> Any:
    def inner() -> None:
        pass

    return inner


@pytest.mark.parametrize(
    ("target", "why"),
    [
        (lambda: None, "is a lambda: .* import it by its module and name"),
        (_make_closure(), "is a function defined inside another: .*define it at module level"),
        (Suite().test_method, "is a bound method"),
        (Suite.test_method, "is a method: a check cannot make its instance"),
        (functools.partial(write_call, "x"), "must be a script path, '-m module' or a module-level function"),
        (functools.lru_cache(write_call), "not what importing test_testing_runner and looking up write_call"),
    ],
    ids=["lambda", "closure", "bound-method", "method", "partial", "replaced"],
)
def test_functions_the_fresh_processes_cannot_import_are_refused_with_the_reason(
    target: Any, why: str
) -> None:
    with pytest.raises(TypeError, match=why):
        function_call(target)


def test_a_function_of_main_is_refused() -> None:
    def main_function() -> None:
        pass

    main_function.__module__ = "__main__"
    main_function.__qualname__ = "main_function"
    with pytest.raises(TypeError, match=r"defined in __main__ .* move it into a module"):
        function_call(main_function)


@pytest.mark.parametrize(
    "value",
    [(1, 2), {1: "a"}, float("nan"), object(), {"p": Path("x")}, b"x"],
    ids=["tuple", "int-keys", "nan", "object", "nested-path", "bytes"],
)
def test_arguments_that_would_not_arrive_unchanged_are_refused_by_name(value: Any) -> None:
    with pytest.raises(TypeError, match=r"argument 'x' \(.*\) cannot be passed .* travel as JSON"):
        function_call(write_call, kwargs={"x": value})
    function_call(write_call, ["fine", 1, 2.5, None, [1], {"a": [True]}])  # control: these travel
