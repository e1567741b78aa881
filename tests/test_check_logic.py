"""check's in-process logic: per-run specs (--vary), run environments, the verdict, option validation.

Nothing here starts a process: the checks that run scripts are in tests/cli and tests/e2e.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrepro import runrecord
from torchrepro.check import (
    VARY_CHOICES,
    CheckResult,
    _no_trace,
    _run_spec,
    _steps_note,
    _thread_notes,
    _varied_text,
    _world_sizes,
    check_script,
)
from torchrepro.check_runs import make_run, rank_notes, varied_workers
from torchrepro.errors import LaunchError, SettingsError
from torchrepro.protocol import ENV_PREFIX, ChildSpec, python_hash_seed
from torchrepro.results import Coverage, Divergence, WorldScope

BASE = ChildSpec(seed=5, mode="warn", max_steps=3)


# --- _run_spec ------------------------------------------------------------------------------------


def test_no_vary_gives_every_run_the_base_spec() -> None:
    assert all(_run_spec(BASE, None, i, seed=5) is BASE for i in range(3))


@pytest.mark.parametrize(("base_threads", "first", "later"), [(None, 1, 2), (1, 1, 2), (2, 2, 1), (8, 8, 1)])
def test_vary_threads_switches_between_one_and_another_count(
    base_threads: int | None, first: int, later: int
) -> None:
    base = BASE.replace(threads=base_threads)
    specs = [_run_spec(base, "threads", i, seed=5) for i in range(3)]
    assert [s.threads for s in specs] == [first, later, later]
    assert all(s.replace(threads=base_threads) == base for s in specs)  # nothing else changes


def test_vary_hashseed_derives_one_per_run_from_the_seed() -> None:
    specs = [_run_spec(BASE, "hashseed", i, seed=5) for i in range(4)]
    hash_seeds = [s.hash_seed for s in specs]
    assert hash_seeds == [python_hash_seed(5, "vary", i) for i in range(4)]
    assert len(set(hash_seeds)) == 4  # different between runs
    assert [_run_spec(BASE, "hashseed", i, seed=5).hash_seed for i in range(4)] == hash_seeds  # stable
    assert _run_spec(BASE, "hashseed", 1, seed=6).hash_seed != hash_seeds[1]  # follows the seed
    assert [s.to_env({})["PYTHONHASHSEED"] for s in specs] == [str(h) for h in hash_seeds]
    assert all(s.replace(hash_seed=None) == BASE for s in specs)


@settings(deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 50))
def test_vary_hashseed_is_a_valid_hash_seed(seed: int, index: int) -> None:
    spec = _run_spec(ChildSpec(seed=seed), "hashseed", index, seed=seed)
    assert spec.hash_seed is not None and 0 <= spec.hash_seed < 2**32


def test_vary_hashseed_of_an_unseeded_check_still_pins_the_hash_seed() -> None:
    spec = _run_spec(ChildSpec(), "hashseed", 1, seed=0)
    env = spec.to_env({})
    assert env["PYTHONHASHSEED"] == str(python_hash_seed(0, "vary", 1))
    assert ENV_PREFIX + "SEED" not in env


def test_vary_workers_changes_only_later_runs() -> None:
    specs = [_run_spec(BASE, "workers", i, seed=5) for i in range(3)]
    assert specs[0] == BASE and specs[0].num_workers is None
    assert [s.num_workers for s in specs[1:]] == ["other", "other"]
    assert specs[1].replace(num_workers=None) == BASE


@pytest.mark.parametrize("vary", ["bogus", "", "Threads"])
def test_vary_of_an_unknown_choice_is_refused(vary: str) -> None:
    with pytest.raises(ValueError, match="vary must be one of"):
        _run_spec(BASE, vary, 1, seed=5)


@pytest.mark.parametrize("threads", [None, 3])
def test_vary_world_gives_every_run_the_same_threads(threads: int | None) -> None:
    base = BASE.replace(threads=threads)
    specs = [_run_spec(base, "world", i, seed=5) for i in range(3)]
    assert {s.threads for s in specs} == {threads or 1}  # only the number of processes varies
    assert all(s.replace(threads=threads) == base for s in specs)


@pytest.mark.parametrize(
    ("vary", "nproc", "runs", "expected"),
    [
        (None, None, 2, [None, None]),
        ("threads", 3, 2, [3, 3]),
        ("world", None, 2, [1, 2]),  # the default: 1 against 2 processes
        ("world", 4, 3, [1, 4, 4]),  # --nproc sets the later runs' processes
    ],
)
def test_world_sizes_of_the_runs(vary: str | None, nproc: int | None, runs: int, expected: list[int]) -> None:
    assert _world_sizes(vary, nproc, runs) == expected


def test_vary_world_with_one_process_is_refused_naming_the_option() -> None:
    with pytest.raises(SettingsError, match=r"--vary world compares 1 process with --nproc N.*got 1"):
        _world_sizes("world", 1, 2)


def test_vary_choices_are_handled() -> None:
    # every advertised choice changes a later run (the refusal above is not what they hit)
    for vary in VARY_CHOICES:
        assert _run_spec(BASE, vary, 1, seed=5) != BASE


# --- _make_run ------------------------------------------------------------------------------------


def test_make_run_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ENV_PREFIX + "SEED", "99")  # the caller's own protocol variables never leak
    command = ["python", "-m", "torchrepro._child.bootstrap", "--", "t.py"]
    run = make_run(1, Path("checks/run1"), command, BASE, ranks=2)
    assert run.index == 1 and run.command == command and run.record_dir == Path("checks/run1")
    assert run.env[ENV_PREFIX + "RECORD_DIR"] == str(tmp_path.resolve() / "checks" / "run1")
    assert Path(run.env[ENV_PREFIX + "RECORD_DIR"]).is_absolute()
    assert run.env[ENV_PREFIX + "SEED"] == "5"
    assert run.env[ENV_PREFIX + "MAX_STEPS"] == "3"
    assert run.env["PYTHONHASHSEED"] == str(python_hash_seed(5))
    assert [t.path for t in run.tails] == [runrecord.events_path(Path("checks/run1"), r) for r in range(2)]
    assert run.proc is None and not (tmp_path / "checks").exists()  # nothing started or created
    assert run.poll() is False and run.steps_done() == 0


def test_steps_done_counts_the_first_optimizers_steps_on_rank_zero(tmp_path: Path) -> None:
    run = make_run(0, tmp_path / "run0", ["python"], BASE, ranks=2)
    run.tails[0].events.extend(
        [
            {"kind": "init", "key": "optimizer0"},
            {"kind": "compute", "key": "optimizer0"},
            {"kind": "compute", "key": "optimizer1"},
            {"kind": "compute", "key": "optimizer0"},
        ]
    )
    run.tails[1].events.append({"kind": "compute", "key": "optimizer0"})
    assert run.steps_done() == 2


def test_stderr_tail_shows_the_whole_last_traceback(tmp_path: Path) -> None:
    run = make_run(0, tmp_path, ["python"], BASE, ranks=1)
    assert run.stderr_tail() == ""  # no stderr file
    lines = [f"noise {i}" for i in range(50)] + ["Traceback (most recent call last):"]
    lines += [f'  File "t.py", line {i}' for i in range(30)] + ["ValueError: boom"]
    (tmp_path / runrecord.STDERR_FILE).write_text("\n".join(lines) + "\n")
    tail = run.stderr_tail().splitlines()
    assert tail[0] == "Traceback (most recent call last):" and tail[-1] == "ValueError: boom"
    (tmp_path / runrecord.STDERR_FILE).write_text("\n".join(f"line {i}" for i in range(100)))
    assert run.stderr_tail(lines=5).splitlines() == [f"line {i}" for i in range(95, 100)]


def test_a_rank_without_a_record_is_said_apart_for_runs_the_check_stopped(tmp_path: Path) -> None:
    """A run the check stopped at a divergence may not have started rank 1 yet: said apart."""
    runs = []
    for i in range(3):
        d = tmp_path / f"run{i + 1}"
        d.mkdir()
        runrecord.events_path(d, 0).write_text("")
        runrecord.write_world(d, 0, 2)  # rank 0 saw a world of 2 ranks
        run = make_run(i, d, ["python", "t.py"], BASE, ranks=1)
        run.add_ranks(run.discover())
        runs.append(run)
    runrecord.events_path(runs[2].record_dir, 1).write_text("")  # run 3's rank 1 recorded
    runs[0].returncode = 0  # ended by itself, without a record of rank 1
    runs[1].returncode = None  # stopped by the check before it ended
    runs[2].returncode = 0
    notes = rank_notes(runs, None)
    missing = "rank 1 (started by the script) wrote no record in run(s)"
    stopped = "rank 1 (started by the script) had written no record when the check stopped run(s)"
    assert len(notes) == 2 and notes[0].startswith(f"{missing} 1:") and notes[1].startswith(f"{stopped} 2,")
    runs[1].returncode = 0  # had it ended by itself, it would be named with run 1
    assert rank_notes(runs, None) == [notes[0].replace(f"{missing} 1:", f"{missing} 1, 2:")]


# --- CheckResult ----------------------------------------------------------------------------------


def test_check_result_to_dict_shape() -> None:
    ok = CheckResult(reproducible=True, runs=2, steps_compared=4, first_divergence=None, check_dir="/c")
    assert ok.to_dict() == {
        "reproducible": True,
        "runs": 2,
        "steps_compared": 4,
        "optimizer_steps": 0,
        "steps_per_optimizer": {},
        "first_divergence": None,
        "inconclusive": False,
        "reason": None,
        "varied": None,
        "portable": None,
        "coverage": None,
        "notes": [],
        "repro": None,
    }
    d = Divergence(step=3, rank=1, kind="compute", op="aten.mm", module="fc", location="t.py:9")
    diverged = CheckResult(reproducible=False, runs=3, steps_compared=4, first_divergence=d, check_dir="/c")
    data = diverged.to_dict()
    assert data["first_divergence"] == {
        "step": 3,
        "rank": 1,
        "kind": "compute",
        "op": "aten.mm",
        "module": "fc",
        "location": "t.py:9",
        "key": None,
        "name": None,
        "shape": None,
        "dtype": None,
    }
    assert "error" not in data and json.loads(json.dumps(data)) == data
    assert "world" not in data  # only with --vary world
    across = CheckResult(
        reproducible=True,
        runs=2,
        steps_compared=4,
        first_divergence=None,
        check_dir="/c",
        world=WorldScope(1, 2),
    )
    assert across.to_dict()["world"] == {
        "processes": [1, 2],
        "reference_rank": 0,
        "compared": ["init", "compute", "final"],
        "not_compared": ["data", "record", "backward"],
    }


def test_check_result_error_only_when_set() -> None:
    failed = CheckResult(
        reproducible=None,
        runs=2,
        steps_compared=0,
        first_divergence=None,
        check_dir="/c",
        error="run 2 of 2 failed with exit code 1",
        returncode=1,
        stderr_tail="Traceback...",
    )
    data = failed.to_dict()
    assert data == {
        "reproducible": None,
        "runs": 2,
        "steps_compared": 0,
        "optimizer_steps": 0,
        "steps_per_optimizer": {},
        "first_divergence": None,
        "inconclusive": False,  # a failed run is an error, not an inconclusive verdict
        "reason": None,
        "varied": None,
        "portable": None,
        "coverage": None,
        "notes": [],
        "repro": None,
        "error": "run 2 of 2 failed with exit code 1",
    }


# --- check_script's validation: before any directory is created -----------------------------------


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("raise SystemExit('must not run')\n")
    return str(path)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"runs": 1}, "runs must be >= 2"),
        ({"runs": 0}, "runs must be >= 2"),
        ({"steps": 0}, "steps must be >= 1"),
        ({"vary": "bogus"}, "vary must be one of"),
        ({"mode": "loose"}, "mode"),
        ({"threads": 0}, "threads"),
        ({"cpu_capability": "sse9"}, "cpu_capability"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_options_raise_before_any_directory(
    tmp_path: Path, script: str, options: dict[str, Any], match: str
) -> None:
    root = tmp_path / "checks"
    with pytest.raises(ValueError, match=match):
        check_script(script, root=root, **options)
    assert not root.exists()


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ({"script": "missing.py"}, "script not found"),
        ({"script": None}, "no script given"),
        ({"script": None, "module": "no_such_module_xyz"}, "module not found"),
    ],
)
def test_missing_target_is_a_launch_error_before_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: dict[str, Any], match: str
) -> None:
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "checks"
    with pytest.raises(LaunchError, match=match):
        check_script(root=root, **target)
    assert not root.exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("options", [{"nproc": 0}, {"nproc": -2}, {"module": "json"}])
def test_launch_options_are_refused_before_any_directory(
    tmp_path: Path, script: str, options: dict[str, Any]
) -> None:
    root = tmp_path / "checks"
    with pytest.raises(LaunchError):
        check_script(script, root=root, **options)
    assert not root.exists()


@pytest.mark.parametrize(("var", "value"), [("MKL_CBWR", "AVX3"), ("ATEN_CPU_CAPABILITY", "avx9")])
def test_portable_refuses_a_value_of_the_user_before_any_directory(
    tmp_path: Path, script: str, monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    root = tmp_path / "checks"
    with pytest.raises(SettingsError, match=f"--portable: {var}={value!r} in the environment is not"):
        check_script(script, root=root, portable=True)
    assert not root.exists()


def test_a_located_op_under_vary_threads_is_named_as_portable_fixes_it_or_not() -> None:
    (layer_norm,) = _thread_notes("aten.native_layer_norm_backward.default", portable=True)
    assert "also under --portable (audit TR602" in layer_norm and "fix: Pin the thread count" in layer_norm
    (mm,) = _thread_notes("aten.mm.default", portable=False)
    assert mm.startswith("aten.mm.default depends on the thread count here: oneMKL's GEMM")
    assert mm.endswith("try the check again with --portable")
    assert _thread_notes("aten.mm.default", portable=True) == []  # not known to stay thread-dependent
    assert _thread_notes("aten.relu.default", portable=False) == _thread_notes(None, portable=True) == []


def test_check_runs_wait_passively_unless_the_user_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runs share the cores: spinning OpenMP threads would burn what the other run needs."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    run = make_run(0, tmp_path / "run0", ["python", "x.py"], BASE, ranks=1)
    assert run.env["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert (
        make_run(1, tmp_path / "run1", ["python", "x.py"], BASE, ranks=1).env["OMP_WAIT_POLICY"] == "ACTIVE"
    )


# --- what the verdict says ------------------------------------------------------------------------


def test_what_vary_threads_and_hashseed_changed_in_words() -> None:
    threads = [_run_spec(BASE, "threads", i, seed=5) for i in range(3)]
    assert _varied_text("threads", threads) == "1 vs 2 threads"
    hashed = [_run_spec(BASE, "hashseed", i, seed=5) for i in range(3)]
    h = [python_hash_seed(5, "vary", i) for i in range(3)]
    assert _varied_text("hashseed", hashed) == f"PYTHONHASHSEED {h[0]} vs {h[1]}, {h[2]}"
    assert _varied_text(None, [BASE, BASE]) is None
    assert _varied_text("workers", [BASE, BASE]) is None  # the records say (varied_workers)


def test_what_vary_workers_changed_comes_from_the_records(tmp_path: Path) -> None:
    run = make_run(1, tmp_path / "run1", ["python"], BASE, ranks=2)
    run.record_dir.mkdir()
    runrecord.write_varied(run.record_dir, 0, [(2, 0)])
    assert varied_workers(run, 2) == (
        "--vary workers: num_workers 2 -> 0 in 1 DataLoader (run 2)",
        "num_workers 2 vs 0 in 1 DataLoader",
        None,
    )
    runrecord.write_varied(run.record_dir, 1, [(0, 2), (2, 0)])
    assert varied_workers(run, 2)[1] == "num_workers 0 vs 2 in 1, 2 vs 0 in 2 of 3 DataLoaders"
    empty = make_run(1, tmp_path / "empty", ["python"], BASE, ranks=1)
    _, varied, nothing = varied_workers(empty, 1)
    assert (varied, nothing) == (None, "--vary workers varied nothing: the script created no DataLoader")


def test_steps_that_could_not_be_applied_are_said() -> None:
    none = Coverage(per_rank={0: {"final": 1}}, ranks_expected=(0,))
    assert _steps_note(3, none, 0, unrecorded=False) == (
        "--steps 3 was not applied: the script took no optimizer step and ran no backward() that "
        "torchrepro counts, so every run ran to its end"
    )
    unrecorded = _steps_note(3, none, 0, unrecorded=True)
    assert unrecorded is not None and unrecorded.startswith(
        "--steps 3 could not be applied to what was compared"
    )
    trained = Coverage(per_rank={0: {"init": 1, "compute": 2}}, ranks_expected=(0,))
    assert _steps_note(3, trained, 2, unrecorded=False) == (
        "--steps 3: the script ended after 2 training step(s), before step 3"
    )
    assert _steps_note(2, trained, 2, unrecorded=False) is None  # applied: nothing to say


def test_a_missing_op_trace_names_the_real_reason_never_the_build(tmp_path: Path) -> None:
    first = Divergence(step=2, rank=0, kind="compute", key="optimizer0")
    side = tmp_path / "run-a"
    side.mkdir()
    # the re-runs stopped before the step: they recorded steps 0 and 1 only
    lines = [
        {"i": i, "kind": "compute", "key": "optimizer0", "step": i, "fp": "f", "t": []} for i in range(2)
    ]
    runrecord.events_path(side, 0).write_text("".join(json.dumps(e) + "\n" for e in lines))
    reason = _no_trace(first, tmp_path, 1)
    assert reason.startswith("no op trace was written: the traced re-runs recorded 2 steps of optimizer0 and")
    assert "never reached step 2" in reason and "build" not in reason
    # they reached it, but in a process that does not trace
    lines.append({**lines[0], "step": 2})
    runrecord.events_path(side, 0).write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert "reached step 2: it ran in a process that does not trace" in _no_trace(first, tmp_path, 1)
    # the tracer said why it could not start: that is the reason given
    (side / runrecord.STDERR_FILE).write_text(
        "torchrepro bootstrap: op tracing unavailable: ImportError: no module named 'x'\n"
    )
    assert _no_trace(first, tmp_path, 1) == (
        "no op trace was written: op tracing could not start in the traced re-run "
        "(ImportError: no module named 'x')"
    )


def test_processes_of_one_run_noting_the_same_are_named_once(tmp_path: Path) -> None:
    runs = []
    for i in range(2):
        d = tmp_path / f"run{i}"
        d.mkdir()
        for pid in (11, 12):  # two forked trainers each
            runrecord.write_uncovered(d, pid, ["python", "hogwild.py"], "it was forked")
        runs.append(make_run(i, d, ["python"], BASE, ranks=1))
    assert rank_notes(runs, None) == [
        "run(s) 1, 2: python child `python hogwild.py` was not recorded: it was forked"
    ]


def test_vary_resume_without_isolation_is_inconclusive_and_starts_nothing(tmp_path: Path) -> None:
    # where the kernel refuses the overlay there is no copy of the files to restart in
    from torchrepro.check_resume import check_resume
    from torchrepro.options import CheckOptions
    from torchrepro.results import Isolation

    refused = Isolation(mode="none", root=str(tmp_path), reason="the kernel refused an overlay (EPERM)")
    result = check_resume(
        tmp_path,
        ["false"],
        ["false"],
        BASE,
        CheckOptions(vary="resume"),
        isolation=refused,
        layers=None,
        script="t.py",
        module=None,
        progress=None,
    )
    assert result.reproducible is None and result.inconclusive
    assert result.reason is not None and "the kernel refused an overlay (EPERM)" in result.reason
    assert not any(p.name.startswith("run") for p in tmp_path.iterdir())  # no run was started
