"""``CheckOptions``: one options object for every entry point, tied to the command line's flags."""

from __future__ import annotations

import argparse

import pytest

from torchrepro import cli
from torchrepro.errors import SettingsError
from torchrepro.options import ASSERT_OPTIONS, VARY_CHOICES, CheckOptions
from torchrepro.testing.assertion import CHECK_OPTIONS

DERIVED = {"locate", "isolate", "steps_after_divergence", "repro_threads"}
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
    runs_flags = dests - {"help", "json", "report", "script", "args", "module", "no_locate", "no_isolate"}
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
