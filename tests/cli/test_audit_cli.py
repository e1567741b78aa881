"""`torchrepro audit` end to end: real scripts run in a real child process through the bootstrap.

Each script runs once (about one torch start-up each): a net with three ops that raise under
strict mode on CUDA, a plain CNN (negative control: no error, exit 0), twelve blocks running
one ``forward`` (one finding per op and line, naming the modules), a script with bad settings,
and a failing script.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers import line_of, relative
from torchrepro.cli import main

SCRIPTS = Path(__file__).with_name("audit_scripts")


def _audit_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(["audit", "--json", *argv])
    out = capsys.readouterr().out
    return code, json.loads(out)  # exactly one JSON object on stdout


@pytest.fixture
def plain_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of a user who set nothing for reproducibility."""
    for name in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def test_flagged_ops_name_op_module_and_forwardline_of(
    capsys: pytest.CaptureFixture[str], plain_shell: None
) -> None:
    script = SCRIPTS / "flagged.py"
    code, report = _audit_json(capsys, relative(script))
    assert code == 1
    errors = {
        (f["code"], f["op"], f["module"], f["location"])
        for f in report["findings"]
        if f["severity"] == "error"
    }
    assert errors == {
        ("TR102", "aten._adaptive_avg_pool2d_backward", "pool", line_of(script, "h = self.pool(h)")),
        ("TR133", "aten.scatter_.reduce", None, line_of(script, 'reduce="multiply"')),
        ("TR134", "aten.nanmedian.dim", None, line_of(script, "nanmedian(dim=1)")),
    }
    # documented as raising on CUDA, measured deterministic under strict mode on a GPU: info that says so
    measured = {f["code"]: f for f in report["findings"] if "(measured on an NVIDIA H200" in f["message"]}
    assert {code: measured[code]["severity"] for code in ("TR106", "TR107", "TR116")} == dict.fromkeys(
        ("TR106", "TR107", "TR116"), "info"
    )
    # the probe saw the arguments: bincount without weights and integer cumsum are not reported
    reported = {f["location"] for f in report["findings"]}
    assert (
        line_of(script, "torch.bincount(") not in reported and line_of(script, ".cumsum(1)") not in reported
    )
    assert "TR132" not in {f["code"] for f in report["findings"]}  # no scatter with reduce='add'
    for f in report["findings"]:
        assert set(f) == {"code", "severity", "op", "module", "location", "message", "fix"}
        assert f["message"] and f["fix"]
    assert report["optimizer_steps"] == 1 and report["steps"] == 1
    assert report["settings"]["torch_seeded"] is True and report["settings"]["set_num_threads_called"] is True
    codes = {f["code"] for f in report["findings"]}
    assert "TR208" not in codes and "TR207" not in codes  # the script seeds and pins its threads
    assert "TR201" in codes  # but hash randomisation stays on: only the launcher can fix it


def test_one_finding_per_op_and_line_naming_every_module(
    capsys: pytest.CaptureFixture[str], plain_shell: None
) -> None:
    script = SCRIPTS / "blocks.py"
    code, report = _audit_json(capsys, relative(script))
    assert code == 1  # the pooling has no deterministic backward on CUDA
    findings = report["findings"]
    causes = [(f["code"], f["op"], f["location"]) for f in findings]
    assert len(causes) == len(set(causes)), causes  # one finding per code, op and line
    layer_norms = {f["location"]: f["module"] for f in findings if f["code"] == "TR602"}
    # the twelve blocks' norms run at two lines of Block.forward; the last norm at a line of its own
    assert layer_norms == {
        line_of(script, "self.attn(self.norm1(x))"): "blocks.[0-11].norm1 (12 modules)",
        line_of(script, "self.mlp(self.norm2(x))"): "blocks.[0-11].norm2 (12 modules)",
        line_of(script, "self.head(self.norm(x)"): "norm",
    }
    pooling = [(f["severity"], f["location"], f["module"]) for f in findings if f["code"] == "TR102"]
    assert pooling == [("error", line_of(script, "self.pool(x.transpose"), "blocks.[0-11].pool (12 modules)")]
    (shuffle,) = [f for f in findings if f["code"] == "TR303"]  # both loaders come from make_loader's line
    made = line_of(script, "return DataLoader(")
    assert shuffle["location"] == made
    assert shuffle["message"].endswith(f"This finding covers the 2 DataLoaders created at {made}.")
    for f in findings:  # the JSON shape is as it was: module a string or null
        assert set(f) == {"code", "severity", "op", "module", "location", "message", "fix"}
        assert f["module"] is None or isinstance(f["module"], str)


def test_clean_cnn_exits_0_with_no_error(capsys: pytest.CaptureFixture[str], plain_shell: None) -> None:
    code = main(["audit", relative(SCRIPTS / "clean.py")])
    out = capsys.readouterr().out
    assert code == 0
    assert "ERROR" not in out
    assert "0 error(s)" in out.splitlines()[-1]
    assert "INFO    TR120" in out  # convolution: made deterministic by strict mode, reported as info


def test_settings_the_script_itself_sets(
    capsys: pytest.CaptureFixture[str], plain_shell: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchrepro's own switches in the caller's environment must not leak into the audited run:
    # it audits the script as plain python runs it
    monkeypatch.setenv("TORCHREPRO_SEED", "5")
    monkeypatch.setenv("TORCHREPRO_MODE", "strict")
    script = SCRIPTS / "settings.py"
    code, report = _audit_json(capsys, "--steps", "2", relative(script))
    assert code == 1
    found = {f["code"]: f for f in report["findings"]}
    for expected in ("TR201", "TR203", "TR204", "TR207", "TR208", "TR301", "TR303"):
        assert expected in found, f"{expected} missing from {sorted(found)}"
        assert found[expected]["severity"] in ("warning", "info")
    # strict mode without CUBLAS_WORKSPACE_CONFIG: every matmul would raise on CUDA
    assert found["TR202"]["severity"] == "error"
    # put_ raises under strict mode even on this CPU: the audit still ran both steps and reports it
    assert (found["TR111"]["severity"], found["TR111"]["location"]) == (
        "error",
        line_of(script, "hits.put_("),
    )
    loader_line = line_of(script, "loader = DataLoader(")
    assert found["TR301"]["location"] == loader_line
    assert "Noisy.__getitem__ draws from Python's global random" in found["TR301"]["message"]
    assert "SeededLoader" in found["TR301"]["fix"]
    # two workers reseed random from a base seed drawn from the unseeded torch RNG; reported
    # where __getitem__ draws, naming the loader
    assert found["TR304"]["location"] == line_of(script, "if random.random() < 0.5")
    assert f"2 DataLoader workers of the DataLoader at {loader_line}" in found["TR304"]["message"]
    settings = report["settings"]
    assert settings["optimizer_steps"] == 2
    assert (
        settings["deterministic_algorithms"] is True and settings["warn_only"] is False
    )  # as the script asks
    compile_line = line_of(script, "torch.compile(model)")
    assert settings["compile_calls"] == [{"location": compile_line, "backend": "inductor", "mode": None}]
    # deterministic algorithms turn Inductor's deterministic mode on too: no TR401 for this call
    assert "TR401" not in found


def test_datasets_drawing_from_unseeded_global_rngs(
    capsys: pytest.CaptureFixture[str], plain_shell: None
) -> None:
    script = SCRIPTS / "global_rngs.py"
    code, report = _audit_json(capsys, relative(script))
    assert code == 0  # warnings only
    found = {(f["code"], f["location"]): f for f in report["findings"] if f["location"]}
    # reported at the line of __getitem__ that draws, naming the loader's line
    flips = found.pop(("TR304", line_of(script, "x.flip(0) if random.random()")))
    assert "Flip.__getitem__" in flips["message"] and "Python's global random" in flips["message"]
    assert f"by the DataLoader at {line_of(script, 'flips = DataLoader(')})" in flips["message"]
    assert "random.seed(0)" in flips["fix"] and "sample_rng()" in flips["fix"]
    jitters = found.pop(("TR304", line_of(script, "float(np.random.uniform(")))
    assert "Jitter.__getitem__" in jitters["message"] and "NumPy's global RNG" in jitters["message"]
    assert f"by the DataLoader at {line_of(script, 'jitters = DataLoader(')})" in jitters["message"]
    # the seed comes from random.randint, which nothing seeded: reported where it seeds
    seed = found.pop(("TR305", line_of(script, "    torch.manual_seed(seed)")))
    assert "random.randint" in seed["message"] and "torch.manual_seed" in seed["message"]
    # a RandomSampler without a generator: the fix gives it one, not the DataLoader
    sampler = found.pop(("TR303", line_of(script, "sampled = DataLoader(")))
    assert sampler["fix"].startswith("Give the generator to the sampler: RandomSampler(dataset, generator=")
    # the FakeData-like loader seeds per index: nothing else is reported
    assert found == {}


def test_seeded_script_has_no_global_rng_finding(
    capsys: pytest.CaptureFixture[str], plain_shell: None
) -> None:
    # negative control for the test above: the same datasets, every global RNG seeded with a constant
    code, report = _audit_json(capsys, relative(SCRIPTS / "global_rngs.py"), "seeded")
    assert code == 0
    assert {f["code"] for f in report["findings"]} == {"TR201", "TR202", "TR303"}
    probes = [loader["probe"]["draws"] for loader in report["settings"]["dataloaders"]]
    assert probes == [["random"], ["numpy"], [], []]  # the draws are still seen; they are seeded


def test_loader_built_by_lightning_points_at_the_usersline_of(
    capsys: pytest.CaptureFixture[str], plain_shell: None
) -> None:
    script = SCRIPTS / "lightning_datamodule.py"
    code, report = _audit_json(capsys, relative(script))
    assert code == 0
    (finding,) = [f for f in report["findings"] if f["code"] == "TR304"]
    # where the dataset draws; the loader is the user's line that handed the data to Lightning
    assert finding["location"] == line_of(script, "x.flip(0) if random.random()")
    assert f"by the DataLoader at {line_of(script, 'trainer.fit(')})" in finding["message"]
    assert "Flip.__getitem__" in finding["message"] and "Python's global random" in finding["message"]
    assert "lightning.seed_everything(0, workers=True)" in finding["fix"]


def test_failing_script_exits_2_with_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["audit", "--json", relative(SCRIPTS / "fails.py")])
    captured = capsys.readouterr()
    assert code == 2
    error = json.loads(captured.out)["error"]  # stdout stays JSON under --json
    assert (error["command"], error["exit_code"]) == ("audit", 2) and "exit code 1" in error["message"]
    assert "exit code 1" in captured.err
    assert "RuntimeError: dataset path /nonexistent/train not found" in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["audit", "no_such_script.py"], "no such file"),
        (
            ["audit", "--steps", "0", str(SCRIPTS / "clean.py")],
            "--steps: must be a number of optimizer steps",
        ),
        (["audit"], "give a script"),
    ],
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


@pytest.mark.parametrize("invariant", [False, True], ids=["no_sync", "invariant"])
def test_accumulation_under_stock_ddp_is_named_at_its_line(
    capsys: pytest.CaptureFixture[str], invariant: bool
) -> None:
    script = SCRIPTS / ("accumulating_invariant.py" if invariant else "accumulating_ddp.py")
    _, report = _audit_json(capsys, relative(script))
    found = [f for f in report["findings"] if f["code"] == "TR502"]
    if invariant:  # the negative control: the same training through InvariantDataParallel
        assert found == []
        return
    (finding,) = found
    assert finding["location"] == line_of(script, "# accumulate")
    assert finding["severity"] == "warning" and "InvariantDataParallel" in finding["fix"]
