"""The child bootstrap's pieces that are safe in process: argv parsing, code lookup, early exits.

``main()`` with a valid spec installs process-global hooks (on ``torch.optim.Optimizer``): it is
only run in subprocesses (tests/cli, tests/e2e). Here it is called only where it must return
before configuring anything.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

from torchrepro import runrecord
from torchrepro._child import bootstrap
from torchrepro._child.bootstrap import _module_code, _parse, _script_code
from torchrepro._child.session import MaxStepsReached, Session
from torchrepro.protocol import ENV_PREFIX, PARENT_RANK_VAR, ChildSpec

# --- _parse ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--", "s.py", "a"], ("s.py", None, ["a"])),
        (["s.py"], ("s.py", None, [])),
        (["--", "s.py", "--lr", "1", "--", "-m"], ("s.py", None, ["--lr", "1", "--", "-m"])),
        (["-m", "pkg", "x"], (None, "pkg", ["x"])),
        (["-m", "pkg.train", "--", "--y"], (None, "pkg.train", ["--", "--y"])),
        (["-m", "pkg"], (None, "pkg", [])),
    ],
)
def test_parse(argv: list[str], expected: tuple[str | None, str | None, list[str]]) -> None:
    assert _parse(argv) == expected


@pytest.mark.parametrize("argv", [[], ["--"], ["-m"], ["--", "-m"]])
def test_parse_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match=re.escape("usage: python -m torchrepro._child.bootstrap")):
        _parse(argv)


# --- code lookup ----------------------------------------------------------------------------------


def test_module_code_of_a_module() -> None:
    code, spec = _module_code("json.tool")
    assert spec.name == "json.tool"
    assert spec.origin is not None and code.co_filename == spec.origin
    assert spec.origin.endswith(os.path.join("json", "tool.py"))


def test_module_code_of_a_package_runs_its_main() -> None:
    code, spec = _module_code("unittest")
    assert spec.name == "unittest.__main__"
    assert spec.parent == "unittest"  # so relative imports in __main__ work, as with python -m
    assert code.co_filename.endswith(os.path.join("unittest", "__main__.py"))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz", "No module named no_such_module_xyz"),
        ("json", "No module named json.__main__"),  # a package without __main__
    ],
)
def test_module_code_of_an_unknown_module(name: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        _module_code(name)


def test_module_code_of_a_module_in_a_missing_package() -> None:
    with pytest.raises(SystemExit, match="no_such_pkg_xyz"):
        _module_code("no_such_pkg_xyz.train")


def test_script_code(tmp_path: Path) -> None:
    path = tmp_path / "s.py"
    path.write_text("x = 6 * 7\n")
    code = _script_code(str(path))
    assert code.co_filename == str(path)
    namespace: dict[str, object] = {}
    exec(code, namespace)
    assert namespace["x"] == 42


def test_script_code_is_not_affected_by_the_bootstraps_future_imports(tmp_path: Path) -> None:
    # dont_inherit: the bootstrap's `from __future__ import annotations` must not leak into scripts
    path = tmp_path / "s.py"
    path.write_text("def f(a: int) -> int: ...\nann = f.__annotations__\n")
    namespace: dict[str, object] = {}
    exec(_script_code(str(path)), namespace)
    assert namespace["ann"] == {"a": int, "return": int}


def test_script_code_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("def (\n")
    with pytest.raises(SyntaxError) as info:
        _script_code(str(path))
    assert info.value.filename == str(path)


# --- small pieces of the session ------------------------------------------------------------------


def test_max_steps_ends_after_the_slowest_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    session = Session(ChildSpec(max_steps=2), None)  # no record dir, no tracing: nothing global
    assert session.recorder is None
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    session.on_step(opt, 0, 0)  # two optimizers stepping in turn (a GAN's D and G)
    session.on_step(opt, 1, 0)
    session.on_step(opt, 0, 1)  # optimizer 0 is done...
    with pytest.raises(MaxStepsReached) as info:
        session.on_step(opt, 1, 1)  # ...and now optimizer 1 too
    assert info.value.code == 0 and isinstance(info.value, SystemExit)
    session.close()


def test_no_max_steps_never_ends_the_run() -> None:
    session = Session(ChildSpec(), None)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for step in range(100):
        session.on_step(opt, 0, step)
    session.close()


def test_varied_loaders_are_noted_when_varied_not_only_at_exit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A check stops a run at its first divergence, maybe before close(): the note must exist."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(PARENT_RANK_VAR, "")  # so the mark the session leaves for children is undone
    monkeypatch.delenv(PARENT_RANK_VAR)
    session = Session(ChildSpec(num_workers="other", record_dir=os.fspath(tmp_path)), None)
    session.on_vary(2, 0)
    assert runrecord.read_varied(tmp_path, 0) == [(2, 0)]
    session.on_vary(0, 2)  # a framework building its second loader
    assert runrecord.read_varied(tmp_path, 0) == [(2, 0), (0, 2)]
    session.close()
    assert runrecord.read_varied(tmp_path, 0) == [(2, 0), (0, 2)]


# --- main(): the early exits ----------------------------------------------------------------------


@pytest.fixture
def marker_script(tmp_path: Path) -> Path:
    """A script that leaves a file behind if it ever runs."""
    path = tmp_path / "s.py"
    path.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return path


def _clean_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"MAX_STEPS": "x"}, f"{ENV_PREFIX}MAX_STEPS must be an integer, got 'x'"),
        ({"SEED": "one"}, f"{ENV_PREFIX}SEED must be an integer"),
        ({"THREADS": "0"}, "threads must be a thread count"),
        ({"SEED": "0", "MODE": "loose"}, "mode must be one of"),
        ({"TRACE_STEP": "1"}, "trace_step and trace_out go together"),
    ],
)
@pytest.mark.parametrize("target", ["script", "module"])
def test_malformed_spec_returns_2_before_running_anything(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    marker_script: Path,
    variables: dict[str, str],
    message: str,
    target: str,
) -> None:
    _clean_protocol(monkeypatch)
    for name, value in variables.items():
        monkeypatch.setenv(ENV_PREFIX + name, value)
    argv_before, path_before, main_before = list(sys.argv), list(sys.path), sys.modules["__main__"]
    argv = ["--", str(marker_script)] if target == "script" else ["-m", "json.tool"]
    assert bootstrap.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("torchrepro bootstrap: ") and message in err
    assert err.count("\n") == 1  # one line, no traceback
    assert not (marker_script.parent / "ran").exists()
    assert (sys.argv, sys.path, sys.modules["__main__"]) == (argv_before, path_before, main_before)


def test_missing_script_returns_2_before_reading_the_spec(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv(ENV_PREFIX + "MAX_STEPS", "x")  # not even read: the script check comes first
    assert bootstrap.main(["--", str(tmp_path / "nope.py")]) == 2
    err = capsys.readouterr().err
    assert "can't open file" in err and "nope.py" in err
    assert ENV_PREFIX not in err


def test_main_usage_error_raises_system_exit() -> None:
    with pytest.raises(SystemExit, match="usage"):
        bootstrap.main([])
