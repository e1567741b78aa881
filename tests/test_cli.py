"""The command line in process: parsing, exit codes, rendering of compare and env diff.

Commands that start a script (run, check, audit with a script) are tested through subprocesses
in tests/cli; here only the paths that return before any process is started are run.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from torchrepro.check import VARY_CHOICES, CheckResult
from torchrepro.cli import _script_target, build_parser, main
from torchrepro.env import Environment
from torchrepro.flags import MODES
from torchrepro.protocol import CPU_CAPABILITIES
from torchrepro.results import Coverage, Divergence
from torchrepro.runrecord import events_path, write_env

# --- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["run", "t.py"],
            {"seed": 0, "mode": "strict", "threads": None, "cpu_capability": None, "nproc": None}
            | {"portable": False, "record": None, "overwrite": False, "trace_step": None, "json": False}
            | {"module": None, "script": "t.py", "args": []}
            | {"nnodes": None, "node_rank": None, "rdzv_endpoint": None, "rdzv_backend": "c10d"}
            | {"rdzv_id": "torchrepro", "join_timeout": 300},
        ),
        (
            ["check", "t.py"],
            {"runs": 2, "steps": None, "nproc": None, "seed": 0, "mode": "strict", "threads": None}
            | {"cpu_capability": None, "portable": False, "no_seed": False, "vary": None, "no_locate": False}
            | {"serial": False, "no_isolate": False, "json": False, "module": None, "script": "t.py"}
            | {"args": [], "report": None, "repro": None, "resume_at": None, "resume_args": ()}
            | {"nnodes": None, "node_rank": None, "rdzv_endpoint": None, "rdzv_backend": "c10d"}
            | {"rdzv_id": "torchrepro", "join_timeout": 300},
        ),
        (["compare", "a", "b"], {"run_a": "a", "run_b": "b", "json": False, "report": None}),
        (["audit", "t.py"], {"json": False, "steps": 1, "module": None, "script": "t.py", "args": []}),
        (["env"], {"json": False, "script": None, "env_command": None}),
        (
            ["env", "diff", "a", "b"],
            {"json": False, "script": None, "env_command": "diff", "a": "a", "b": "b", "diff_json": False},
        ),
    ],
)
def test_subcommand_defaults(argv: list[str], expected: dict[str, Any]) -> None:
    args = vars(build_parser().parse_args(argv))
    assert args.pop("command") == argv[0]
    assert args == expected


@pytest.mark.parametrize(
    ("argv", "target"),
    [
        (["run", "t.py"], ("t.py", None, [])),
        (["run", "--seed", "3", "t.py", "a", "--lr", "1"], ("t.py", None, ["a", "--lr", "1"])),
        (["run", "t.py", "--seed", "3"], ("t.py", None, ["--seed", "3"])),  # after the script: its own
        (["run", "t.py", "-m", "x"], ("t.py", None, ["-m", "x"])),
        (["run", "-m", "pkg.train"], (None, "pkg.train", [])),
        (["run", "-m", "pkg.train", "x", "--y"], (None, "pkg.train", ["x", "--y"])),
        (["check", "-m", "pkg", "--", "--lr", "1"], (None, "pkg", ["--lr", "1"])),
        (["audit", "-m", "pkg", "a"], (None, "pkg", ["a"])),
        (["run"], (None, None, [])),
    ],
)
def test_script_target(argv: list[str], target: tuple[str | None, str | None, list[str]]) -> None:
    assert _script_target(build_parser().parse_args(argv)) == target


@pytest.mark.parametrize("rest", [["--seed", "3"], ["--lr", "1"]])
def test_options_after_a_module_are_the_modules_arguments(rest: list[str]) -> None:
    args = build_parser().parse_args(["run", "-m", "pkg", *rest])
    assert args.seed == 0
    assert _script_target(args) == (None, "pkg", rest)


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("7", 7)])
def test_trace_step_accepts_a_step_index(value: str, expected: int) -> None:
    assert build_parser().parse_args(["run", "--trace-step", value, "t.py"]).trace_step == expected


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_trace_step_refuses_anything_else(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["run", "--trace-step", value, "t.py"])
    assert info.value.code == 2
    assert "--trace-step" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "check"])
def test_choices_match_the_library(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for capability in CPU_CAPABILITIES:
        assert (
            parser.parse_args([command, "--cpu-capability", capability, "t.py"]).cpu_capability == capability
        )
    for mode in MODES:
        assert parser.parse_args([command, "--mode", mode, "t.py"]).mode == mode
    for bad in (["--cpu-capability", "sse9"], ["--mode", "loose"]):
        with pytest.raises(SystemExit) as info:
            parser.parse_args([command, *bad, "t.py"])
        assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_vary_choices_match_the_library() -> None:
    parser = build_parser()
    for vary in VARY_CHOICES:
        assert parser.parse_args(["check", "--vary", vary, "t.py"]).vary == vary
    with pytest.raises(SystemExit):
        parser.parse_args(["check", "--vary", "bogus", "t.py"])


def test_no_command_prints_help_and_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage: torchrepro" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("torchrepro ")


# --- usage errors that return before any process ----------------------------------------------------


def test_run_without_a_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = tmp_path / "rec"
    assert main(["run", "--record", str(record)]) == 2
    err = capsys.readouterr().err
    assert "torchrepro run: error: give a script (or -m MODULE)" in err and "Traceback" not in err
    assert not record.exists()


def test_run_of_a_missing_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--record", str(tmp_path / "rec"), str(tmp_path / "nope.py")]) == 2
    assert "script not found" in capsys.readouterr().err
    assert not (tmp_path / "rec").exists()


@pytest.mark.parametrize("argv", [["audit"], ["audit", "--steps", "0", "t.py"], ["audit", "-m"]])
def test_audit_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    assert "torchrepro audit" in capsys.readouterr().err


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)  # a stray .torchrepro/ lands in tmp_path
    path = tmp_path / "train.py"
    path.write_text("raise SystemExit('must not run')\n")
    return str(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--runs", "1"],
        ["check", "--steps", "0"],
        ["check", "--threads", "0"],
        ["run", "--threads", "0"],
        ["run", "--seed", "-1"],
    ],
)
def test_invalid_option_values_are_usage_errors(
    argv: list[str], script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, script]) == 2
    assert f"torchrepro {argv[0]}: error:" in capsys.readouterr().err


def test_run_with_nproc_zero_creates_nothing(
    tmp_path: Path, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "rec"
    assert main(["run", "--nproc", "0", "--record", str(record), script]) == 2
    assert "nproc" in capsys.readouterr().err
    assert not record.exists()


# --- compare --------------------------------------------------------------------------------------


ENV = Environment(torch_version="2.4.0", python_version="3.11.4", num_threads=4, hostname="alpha")


def make_record(path: Path, fps: list[str], env: Environment | None = ENV) -> str:
    path.mkdir()
    lines = [{"i": 0, "kind": "init", "key": "optimizer0", "step": 0, "fp": "init", "t": []}]
    for step, fp in enumerate(fps):
        lines.append({"i": step + 1, "kind": "compute", "key": "optimizer0", "step": step, "fp": fp, "t": []})
    events_path(path, 0).write_text("".join(json.dumps(e) + "\n" for e in lines))
    if env is not None:
        write_env(path, env.to_dict())
    return str(path)


def test_compare_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_record(tmp_path / "a", ["x", "y", "z"])
    b = make_record(tmp_path / "b", ["x", "y", "z"])
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "identical: 3 training steps compared" in out and "NOT" not in out
    assert "environments: no difference recorded" in out


def test_compare_not_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_record(tmp_path / "a", ["x", "y", "z"])
    b = make_record(tmp_path / "b", ["x", "Y", "z"], env=dataclasses.replace(ENV, num_threads=8))
    assert main(["compare", a, b]) == 1
    out = capsys.readouterr().out
    assert "NOT identical: first divergence: compute at step 1" in out
    assert "--trace-step 1" in out  # how to name the op
    assert " ! env num_threads: 4 vs 8" in out
    assert "1 environment difference(s) can break bitwise reproducibility" in out


@pytest.mark.parametrize(("second", "code"), [(["x", "y"], 0), (["x", "Y"], 1)])
def test_compare_json_prints_one_object(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], second: list[str], code: int
) -> None:
    a = make_record(tmp_path / "a", ["x", "y"])
    b = make_record(tmp_path / "b", second)
    assert main(["compare", a, b, "--json"]) == code
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    data = json.loads(out)
    assert data["reproducible"] is (code == 0)
    assert set(data) == {
        "reproducible",
        "runs",
        "steps_compared",
        "optimizer_steps",
        "steps_per_optimizer",
        "first_divergence",
        "inconclusive",
        "reason",
        "coverage",
        "env_differences",
        "tensor",
        "notes",
    }
    assert (data["first_divergence"] is None) == (code == 0)


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_compare_of_a_missing_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], json_flag: list[str]
) -> None:
    a = make_record(tmp_path / "a", ["x"])
    assert main(["compare", "/nonexistent/run", a, *json_flag]) == 2
    out, err = capsys.readouterr()
    if json_flag:  # stdout stays JSON: the error as an object
        error = json.loads(out)["error"]
        assert (error["kind"], error["command"], error["exit_code"]) == ("error", "compare", 2)
        assert error["message"].startswith("run record not found: '/nonexistent/run'")
    else:
        assert out == ""
    assert err.startswith("torchrepro compare: error: run record not found: '/nonexistent/run'")
    assert "Traceback" not in err and err.count("\n") == 1


def test_compare_of_a_damaged_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_record(tmp_path / "a", ["x"])
    b = make_record(tmp_path / "b", ["x"])
    (Path(b) / "env.json").write_text("{")
    assert main(["compare", a, b]) == 2
    assert "damaged" in capsys.readouterr().err


# --- check's verdict, rendered (check_script replaced: no process is started) -----------------------


def _render_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], result: CheckResult
) -> tuple[int, str, str]:
    import torchrepro.check

    monkeypatch.setattr(torchrepro.check, "check_script", lambda *args, **kwargs: result)
    code = main(["check", "train.py"])
    out, err = capsys.readouterr()
    return code, out, err


COVERED = Coverage(per_rank={0: {"init": 2, "compute": 40}}, ranks_expected=(0,))


def test_check_counts_steps_as_the_user_does_and_says_what_was_varied(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = CheckResult(
        reproducible=True,
        runs=2,
        steps_compared=20,
        first_divergence=None,
        check_dir="/c/1",
        coverage=COVERED,
        varied="1 vs 2 threads",
        optimizer_steps={"optimizer0": 20, "optimizer1": 20},
    )
    code, out, _ = _render_check(monkeypatch, capsys, result)
    assert code == 0
    assert out.splitlines()[0] == (
        "reproducible: 2 runs identical over 20 training steps (40 optimizer steps: 2 optimizers x 20) "
        "with 1 vs 2 threads"
    )
    uneven = dataclasses.replace(result, varied=None, optimizer_steps={"optimizer0": 20, "optimizer1": 25})
    out = _render_check(monkeypatch, capsys, uneven)[1]
    assert out.splitlines()[0].endswith(
        "over 20 training steps (45 optimizer steps: 20 + 25 of 2 optimizers)"
    )
    single = dataclasses.replace(result, varied=None, optimizer_steps={"optimizer0": 20})
    assert _render_check(monkeypatch, capsys, single)[1].splitlines()[0] == (
        "reproducible: 2 runs identical over 20 training steps"
    )
    assert "portable" not in _render_check(monkeypatch, capsys, single)[1]


def test_a_portable_check_says_what_portable_mode_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    values = {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2", "onednn": False}
    result = CheckResult(
        reproducible=True,
        runs=2,
        steps_compared=3,
        first_divergence=None,
        check_dir="/c/1",
        coverage=COVERED,
        varied="1 vs 2 threads",
        portable=values,
    )
    out = _render_check(monkeypatch, capsys, result)[1]
    assert "  portable: MKL_CBWR=AVX2,STRICT, ATEN_CPU_CAPABILITY=avx2, oneDNN off" in out.splitlines()
    unpinned = dataclasses.replace(result, portable={**values, "ATEN_CPU_CAPABILITY": None})
    assert "  portable: MKL_CBWR=AVX2,STRICT, oneDNN off" in _render_check(monkeypatch, capsys, unpinned)[1]


def test_an_inconclusive_check_gives_its_reason_in_the_headline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = CheckResult(
        reproducible=None,
        runs=2,
        steps_compared=20,
        first_divergence=None,
        check_dir="/c/1",
        coverage=COVERED,
        reason="--vary workers varied nothing: the script created no DataLoader",
        optimizer_steps={"optimizer0": 20},
    )
    code, out, _ = _render_check(monkeypatch, capsys, result)
    assert code == 3
    assert out.splitlines()[:2] == [
        "INCONCLUSIVE: --vary workers varied nothing: the script created no DataLoader",
        "  (2 runs did not differ; 20 training steps compared)",
    ]
    assert "not enough was compared" not in out


def test_a_final_state_divergence_is_said_so_and_the_record_path_printed_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    d = Divergence(step=0, rank=0, kind="compute", key="final", name="final:model.0.weight", shape=(8, 4))
    d = replace(d, dtype="float32")
    reason = (
        "the runs differ only in the final state of model: the training that changed it was not recorded (x)"
    )
    result = CheckResult(
        reproducible=False,
        runs=2,
        steps_compared=0,
        first_divergence=d,
        check_dir="/checks/final-1",
        coverage=Coverage(per_rank={0: {"final": 1}}, ranks_expected=(0,)),
        reason=reason,
    )
    code, out, err = _render_check(monkeypatch, capsys, result)
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == f"NOT reproducible: {reason}"
    assert (
        lines[1]
        == "  first differing: final value of model.0.weight float32[8, 4] (0 training steps compared)"
    )
    assert "compute at step 0" not in out
    assert "nothing beyond init" not in out  # a definite divergence carries no inconclusive remark
    assert (out + err).count("/checks/final-1") == 1
    # a divergence in a step: its usual line, and the path once too
    step = dataclasses.replace(
        result, first_divergence=Divergence(step=3, rank=0, kind="compute", key="optimizer0")
    )
    out, err = _render_check(monkeypatch, capsys, dataclasses.replace(step, reason=None, steps_compared=4))[
        1:
    ]
    assert out.splitlines()[:2] == [
        "NOT reproducible: first divergence: compute at step 3",
        "  (4 training steps compared)",
    ]
    assert (out + err).count("/checks/final-1") == 1


def test_compare_leaves_out_what_every_two_records_differ_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_env = dataclasses.replace(
        ENV, collected_at="2026-01-01T00:00:00+00:00", env_vars={"TORCHREPRO_RECORD_DIR": "/r/a"}
    )
    b_env = dataclasses.replace(
        a_env,
        collected_at="2026-01-01T00:00:05+00:00",
        hostname="beta",
        env_vars={"TORCHREPRO_RECORD_DIR": "/r/b"},
    )
    a = make_record(tmp_path / "a", ["x", "y"], env=a_env)
    b = make_record(tmp_path / "b", ["x", "y"], env=b_env)
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "collected_at" not in out and "RECORD_DIR" not in out and "/r/a" not in out
    assert "harmless env differences: hostname" in out
    assert " ! " not in out  # nothing that breaks reproducibility
    assert main(["compare", a, b, "--json"]) == 0
    listed = {d["key"]: d["volatile"] for d in json.loads(capsys.readouterr().out)["env_differences"]}
    assert listed == {"collected_at": True, "env_vars.TORCHREPRO_RECORD_DIR": True, "hostname": False}


# --- env diff -------------------------------------------------------------------------------------


def env_file(path: Path, env: Environment) -> str:
    path.write_text(json.dumps(env.to_dict()))
    return str(path)


def test_env_diff_equal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = env_file(tmp_path / "a.json", ENV), env_file(tmp_path / "b.json", ENV)
    assert main(["env", "diff", a, b]) == 0
    assert "no difference" in capsys.readouterr().out


def test_env_diff_harmless_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = env_file(tmp_path / "a.json", ENV)
    b = env_file(tmp_path / "b.json", dataclasses.replace(ENV, hostname="beta"))
    assert main(["env", "diff", a, b]) == 0
    out = capsys.readouterr().out
    assert "harmless (1)" in out and "verdict: nothing that matters" in out


def test_env_diff_breaking_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = env_file(tmp_path / "a.json", ENV)
    b = env_file(tmp_path / "b.json", dataclasses.replace(ENV, torch_version="2.5.0"))
    assert main(["env", "diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "can break bitwise reproducibility (1)" in out
    assert "torch_version: 2.4.0 -> 2.5.0" in out
    assert "verdict: something that matters differs" in out


def test_env_diff_json_and_run_record_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_record(tmp_path / "a", ["x"])  # a run record directory: its env.json
    b = env_file(tmp_path / "b.json", dataclasses.replace(ENV, num_threads=1))
    assert main(["env", "diff", a, b, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["breaks"] is True
    assert [(d["key"], d["a"], d["b"]) for d in data["differences"]] == [("num_threads", 4, 1)]


@pytest.mark.parametrize("which", ["a", "b"])
def test_env_diff_of_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str) -> None:
    good = env_file(tmp_path / "good.json", ENV)
    missing = str(tmp_path / "missing.json")
    argv = [missing, good] if which == "a" else [good, missing]
    assert main(["env", "diff", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "torchrepro env: error:" in err and "missing.json" in err and "Traceback" not in err


def test_env_diff_of_a_malformed_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = env_file(tmp_path / "good.json", ENV)
    bad = tmp_path / "bad.json"
    bad.write_text('{"torch_version": 3}')
    assert main(["env", "diff", good, str(bad)]) == 2
    assert "malformed" in capsys.readouterr().err
