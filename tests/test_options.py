"""``CheckOptions``: one options object for every entry point, tied to the command line's flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from torchrepro import cli
from torchrepro.errors import SettingsError
from torchrepro.options import ASSERT_OPTIONS, VARY_CHOICES, CheckOptions
from torchrepro.testing.assertion import CHECK_OPTIONS

DERIVED = {"locate", "isolate", "steps_after_divergence", "repro_threads", "nodes"}
"""Fields a ``torchrepro check`` flag sets under another name (``--no-locate``, ``--no-isolate``) or
that ``--report`` derives."""
INTERNAL = {"root", "poll_interval"}
"""Fields only the library's callers set (where the records go; how often the runs are looked at)."""


def _check_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["check"]


def test_every_field_is_a_check_flag_or_derived_from_one_or_internal() -> None:
    dests = {a.dest for a in _check_parser()._actions}
    fields = set(CheckOptions.fields())
    assert set(cli.CHECK_FLAGS) <= dests & fields
    assert fields == set(cli.CHECK_FLAGS) | DERIVED | INTERNAL
    # every flag of check that is an option of the runs reaches a field
    nodes = {"nnodes", "node_rank", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "join_timeout"}
    runs_flags = dests - {
        "help",
        "json",
        "report",
        "script",
        "args",
        "module",
        "no_locate",
        "no_isolate",
        *nodes,
    }
    assert runs_flags == set(cli.CHECK_FLAGS)


def test_the_command_line_builds_the_options_its_flags_say() -> None:
    args = _check_parser().parse_args(
        [
            "--runs",
            "3",
            "--steps",
            "4",
            "--vary",
            "threads",
            "--no-locate",
            "--no-isolate",
            "--seed",
            "7",
            "t.py",
        ]
    )
    options = cli.check_options(args)
    assert options == CheckOptions(runs=3, steps=4, vary="threads", locate=False, isolate=False, seed=7)
    report = _check_parser().parse_args(["--report", "out.html", "t.py"])
    assert cli.check_options(report) == CheckOptions(
        steps_after_divergence=cli.REPORT_STEPS_AFTER, repro_threads=True
    )


def test_assert_reproducible_takes_the_runs_options_by_keyword() -> None:
    assert CHECK_OPTIONS == ASSERT_OPTIONS
    assert set(ASSERT_OPTIONS) == set(CheckOptions.fields()) - {
        "runs",
        "steps",
        "vary",
        "steps_after_divergence",
        "repro",
        "repro_threads",
        "poll_interval",
        "nodes",
    }
    assert list(ASSERT_OPTIONS) == sorted(ASSERT_OPTIONS)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"runs": 1}, "runs must be >= 2"),
        ({"steps": 0}, "steps must be >= 1"),
        ({"vary": "moon"}, "vary must be one of"),
        ({"steps_after_divergence": -1}, "steps_after_divergence must be >= 0"),
        ({"repro": "out", "locate": False}, "drop --no-locate"),
        ({"resume_at": (3,)}, "--resume-at and --resume-args go with --vary resume"),
        ({"resume_args": ("--resume",)}, "go with --vary resume"),
        ({"vary": "resume", "isolate": False}, "drop --no-isolate"),
        ({"vary": "resume", "runs": 3}, "drop --runs 3"),
        (
            {"vary": "resume", "steps": 5, "resume_at": (2, 5)},
            "--resume-at 5 is not before the last of --steps 5",
        ),
        ({"vary": "resume", "resume_at": (0,)}, "resume_at must be optimizer step counts >= 1"),
        ({"vary": "resume", "resume_at": ("2",)}, "resume_at must be"),
        ({"vary": "resume", "resume_at": (True,)}, "resume_at must be"),
        ({"vary": "resume", "resume_at": ()}, "resume_at must be"),
        ({"vary": "resume", "resume_args": "--resume"}, "a list of arguments, got the string"),
    ],
)
def test_bad_values_are_refused_when_built(changes: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        CheckOptions.build(**changes)


def test_build_and_replace() -> None:
    base = CheckOptions.build(runs=3)
    assert base.replace(vary="hashseed") == CheckOptions(runs=3, vary="hashseed")
    assert base.runs == 3 and CheckOptions.build(base) == base
    with pytest.raises(TypeError, match=r"unknown check option\(s\) 'nprocs'; the options are runs, steps"):
        CheckOptions.build(nprocs=2)
    with pytest.raises(SettingsError):
        base.replace(runs=0)
    assert "world" in VARY_CHOICES


def test_resume_points_are_kept_sorted_and_distinct() -> None:
    assert CheckOptions(vary="resume", resume_at=5).resume_at == (5,)  # type: ignore[arg-type]
    assert CheckOptions(vary="resume", resume_at=(5, 2, 5)).resume_at == (2, 5)
    assert CheckOptions(vary="resume", resume_args=["--resume", 3]).resume_args == ("--resume", "3")  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("argv", "resume_at", "resume_args", "script_args"),
    [
        (["--resume-at", "2,5", "t.py"], (2, 5), (), []),
        (["--resume-args", "--resume", "t.py"], None, ("--resume",), []),  # a value starting with -
        (
            ["--resume-args", "--from 'a b'", "t.py", "--resume-args", "x"],
            None,
            ("--from", "a b"),
            ["--resume-args", "x"],
        ),
        (["--resume-args=--resume", "t.py"], None, ("--resume",), []),
    ],
)
def test_the_resume_flags(
    argv: list[str], resume_at: tuple[int, ...] | None, resume_args: tuple[str, ...], script_args: list[str]
) -> None:
    args = cli.build_parser().parse_args(["check", "--vary", "resume", *argv])
    assert (args.resume_at, args.resume_args, args.script, args.args) == (
        resume_at,
        resume_args,
        "t.py",
        script_args,
    )
    assert cli.check_options(args).resume_at == resume_at


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--vary", "resume", "--resume-at", "0"], "must be optimizer step counts separated by commas"),
        (["--vary", "resume", "--resume-at", "2,x"], "must be optimizer step counts"),
        (["--vary", "resume", "--resume-args", "'unclosed"], "must be arguments as a shell writes them"),
        (["--vary", "resume", "--no-isolate"], "drop --no-isolate"),
        (["--resume-at", "3"], "go with --vary resume"),
    ],
)
def test_bad_resume_flags_are_usage_errors(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("raise SystemExit('must not run')\n")
    assert cli.main(["check", *argv, "t.py"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / ".torchrepro").exists()


def test_resume_options_go_with_vary_resume_in_assert_reproducible() -> None:
    from torchrepro.testing import assert_reproducible

    with pytest.raises(TypeError, match="resume_at go with vary='resume'"):
        assert_reproducible("t.py", vary="threads", resume_at=3)
