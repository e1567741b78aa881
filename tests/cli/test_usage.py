"""Usage errors, -m, record directories, signals, --json: the command line as a careless user meets it.

Usage errors are checked in process (``cli.main``); what needs a real child (exit codes of a
killed script, ``-m`` semantics, torchrun failures) runs ``python -m torchrepro`` for real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import torchrepro
from torchrepro import runrecord
from torchrepro._proc import exit_code
from torchrepro.cli import build_parser, main
from torchrepro.launch import nproc_note


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.py"
    path.write_text("print('ran')\n")
    return path


USAGE_ERRORS = [
    ["check", "--runs", "0"],
    ["check", "--runs", "1"],
    ["check", "--runs", "-1"],
    ["check", "--steps", "0"],
    ["check", "--steps", "-1"],
    ["check", "--seed", "-1"],
    ["check", "--seed", str(2**64)],
    ["run", "--seed", "-1"],
    ["run", "--seed", str(2**64)],
    ["run", "--seed", "x"],
    ["run", "--threads", "0"],
    ["run", "--threads", "-3"],
    ["check", "--threads", "0"],
    ["check", "--threads", "-3"],
    ["run", "--nproc", "0"],
    ["check", "--nproc", "-2"],
    ["run", "--mode", "loose"],
    ["run", "--cpu-capability", "sse9"],
    ["check", "--vary", "everything"],
    ["check", "--vary", "world", "--nproc", "1"],  # 1 process against 1: nothing would vary
    ["audit", "--steps", "0"],
    ["run", "--trace-step", "-1"],
    ["check", "--repro", "train.py"],  # a file, not a new or empty directory
    ["check", "--no-locate", "--repro", "new"],  # nothing located: no op to write a script of
]


@pytest.mark.parametrize("argv", USAGE_ERRORS, ids=" ".join)
def test_usage_errors_are_one_line_exit_2_and_create_nothing(
    argv: list[str], script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, str(script)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"torchrepro {argv[0]}: error: ")
    assert argv[1] in err  # names the option
    assert sorted(os.listdir(tmp_path)) == ["train.py"]  # no run or check directory


@pytest.mark.parametrize("command", ["run", "check"])
def test_portable_takes_no_value_and_refuses_an_unusable_environment_in_one_line(
    command: str,
    script: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert main([command, "--portable=yes", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--portable: ignored explicit argument 'yes'" in err
    monkeypatch.setenv("MKL_CBWR", "AVX3,STRICT")
    assert main([command, "--portable", str(script)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(
        f"torchrepro {command}: error: --portable: MKL_CBWR='AVX3,STRICT' in the environment is not a "
        "value oneMKL accepts (<branch>[,STRICT], e.g. AVX2,STRICT); unset it"
    )
    assert sorted(os.listdir(tmp_path)) == ["train.py"]  # no run or check directory
    monkeypatch.setenv("MKL_CBWR", "AVX2,STRICT")  # control: a valid value passes parsing and validation
    assert build_parser().parse_args([command, "--portable", str(script)]).portable is True


def test_run_record_into_a_file_is_a_usage_error(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    assert main(["run", "--record", str(target), str(script)]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a directory" in err and err.count("\n") == 1
    assert target.read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "train.py"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(option=st.sampled_from(["--runs", "--steps", "--threads", "--seed", "--nproc"]), value=st.integers())
def test_integer_options_parse_or_refuse_in_one_line(option: str, value: int) -> None:
    """Any integer: accepted within the option's range, else exit 2 with one line naming it."""
    lowest = {"--runs": 2, "--steps": 1, "--threads": 1, "--seed": 0, "--nproc": 1}[option]
    highest = 2**64 - 1 if option == "--seed" else None
    valid = value >= lowest and (highest is None or value <= highest)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = build_parser().parse_args(["check", option, str(value), "t.py"])
        except SystemExit as exc:
            assert not valid and exc.code == 2
            assert err.getvalue().count("\n") == 1 and option in err.getvalue()
            return
    assert valid and getattr(args, option.lstrip("-")) == value


def test_every_flag_has_help_text() -> None:
    parser = build_parser()
    missing = []

    def visit(p: object, prefix: str) -> None:
        import argparse

        assert isinstance(p, argparse.ArgumentParser)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    visit(sub, f"{prefix} {name}")
            elif not (action.help or "").strip():
                missing.append(f"{prefix} {'/'.join(action.option_strings) or action.dest}")

    visit(parser, "torchrepro")
    assert missing == []


def test_nproc_note_only_beyond_the_cpu_count() -> None:
    cpus = os.cpu_count() or 1
    assert nproc_note(None) is None and nproc_note(cpus) is None
    note = nproc_note(cpus + 1)
    assert note is not None and f"--nproc {cpus + 1}" in note and f"{cpus} CPU" in note


# --- record directories ---------------------------------------------------------------------------


def test_run_refuses_a_directory_that_holds_files(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "rec"
    record.mkdir()
    (record / "settings.json").write_text('{"mine": true}')  # a user's file that happens to share a name
    assert main(["run", "--record", str(record), str(script)]) == 2
    err = capsys.readouterr().err
    assert "already holds 1 file(s) (settings.json)" in err and "--overwrite" in err
    assert os.listdir(record) == ["settings.json"]  # untouched: no lock file, nothing written
    assert (record / "settings.json").read_text() == '{"mine": true}'


def test_overwrite_replaces_the_record_and_keeps_other_files(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "rec"
    assert main(["run", "--record", str(record), str(script)]) == 0  # a new directory is fine
    (record / "notes.txt").write_text("keep me")
    (record / "events.rank3.jsonl").write_text("stale\n")  # a rank the next run will not have
    (record / "trace-step9.rank0").write_text("stale")
    assert main(["run", "--record", str(record), "--overwrite", str(script)]) == 0
    names = set(os.listdir(record))
    assert {"notes.txt", "events.rank0.jsonl", "settings.json", "env.json", "command.json"} <= names
    assert "events.rank3.jsonl" not in names and "trace-step9.rank0" not in names
    assert (record / "notes.txt").read_text() == "keep me"
    capsys.readouterr()


def test_a_record_directory_in_use_is_refused(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "rec"
    with runrecord.claim(record):  # another run is writing here
        assert main(["run", "--record", str(record), "--overwrite", str(script)]) == 2
        assert "being written by another run" in capsys.readouterr().err
    assert main(["run", "--record", str(record), "--overwrite", str(script)]) == 0  # free again


# --- real children ----------------------------------------------------------------------------------


def test_dash_m_behaves_like_python(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import sys\nprint('ARGV', sys.argv[1:])\n")
    (tmp_path / "fails.py").write_text("raise SystemExit(3)\n")
    out = torchrepro(tmp_path, "run", "-m", "pkg", "--lr", "1", "--seed", "3")
    assert out.returncode == 0, out.stderr  # ends without sys.exit: 0, like python -m
    assert "ARGV ['--lr', '1', '--seed', '3']" in out.stdout  # the module's arguments, not torchrepro's
    settings_file = next(Path(tmp_path, ".torchrepro/runs").iterdir()) / runrecord.SETTINGS_FILE
    assert json.loads(settings_file.read_text())["seed"] == 0  # --seed after -m was not torchrepro's
    assert torchrepro(tmp_path, "run", "-m", "fails").returncode == 3  # control: codes pass through
    python = subprocess.run(
        [sys.executable, "-m", "pkg", "--lr", "1"], cwd=tmp_path, capture_output=True, text=True
    )
    assert python.returncode == 0 and "ARGV ['--lr', '1']" in python.stdout


@pytest.mark.parametrize(
    ("body", "signum"),
    [
        ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", signal.SIGTERM),
        ("raise KeyboardInterrupt\n", 2),
    ],
)
def test_a_killed_script_exits_128_plus_n_as_a_shell_reports(tmp_path: Path, body: str, signum: int) -> None:
    script = tmp_path / "dies.py"
    script.write_text("def train():\n    pass\n\n\ntrain()\n" + body)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    out = torchrepro(tmp_path, "run", str(script))
    assert out.returncode == 128 + signum == exit_code(plain.returncode)
    assert f"exit code {128 + signum}" in out.stderr
    if signum == 2:  # the traceback is the user's, as python shows it
        assert 'File "' in out.stderr and "dies.py" in out.stderr
        assert "bootstrap.py" not in out.stderr and "supervisor.py" not in out.stderr


def test_run_json_and_check_json_notes(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("print('hello')\n")
    out = torchrepro(tmp_path, "run", "--json", str(script))
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["exit_code"] == 0 and Path(tmp_path, data["record"], runrecord.SETTINGS_FILE).is_file()
    out = torchrepro(tmp_path, "check", "--json", "--no-locate", str(script))
    verdict = json.loads(out.stdout)
    assert "notes" in verdict and isinstance(verdict["notes"], list)


def test_a_failed_rank_is_one_line_not_torchruns_traceback(tmp_path: Path) -> None:
    script = tmp_path / "ddp_fail.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('rank 1 is broken')\n"
        "dist.barrier()\n"
    )
    out = torchrepro(tmp_path, "run", "--nproc", "2", str(script))
    assert out.returncode == 1
    assert "torchrepro: rank 1 failed with exit code 1" in out.stderr
    assert "ValueError: rank 1 is broken" in out.stderr  # the rank's own traceback is kept
    assert "ChildFailedError" not in out.stderr and "Root Cause" not in out.stderr
