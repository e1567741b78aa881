"""`torchrepro audit` on what a CPU run alone does not show: seeds whose origin only the
script's source tells (a small draw, a generator seeded from the clock).

Real scripts run once each in a real child process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from torchrepro.cli import main

SCRIPTS = Path(__file__).with_name("audit_scripts")


def _rel(path: Path) -> str:
    return os.path.relpath(path, os.getcwd())


def _lines(script: Path, text: str) -> list[str]:
    """``file:line`` of every line of ``script`` that contains ``text``."""
    lines = script.read_text().splitlines()
    return [f"{_rel(script)}:{n}" for n, t in enumerate(lines, start=1) if text in t]


def _audit(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    main(["audit", "--json", *argv])
    return json.loads(capsys.readouterr().out)


def test_seeds_from_unseeded_sources_whatever_their_size(capsys: pytest.CaptureFixture[str]) -> None:
    script = SCRIPTS / "seeds.py"
    report = _audit(capsys, _rel(script))
    tainted = {f["location"]: f["message"] for f in report["findings"] if f["code"] == "TR305"}
    assert sorted(tainted) == sorted(_lines(script, "# tainted"))
    clock_ns, clock_s, pid, entropy, urandom = _lines(script, "# tainted")[:5]
    assert tainted[clock_ns].startswith(
        "torch.Generator().manual_seed seeds a torch.Generator from the current"
    )
    assert "the current time" in tainted[clock_s] and "the process id" in tainted[pid]
    assert "secrets.randbelow" in tainted[entropy] and "os.urandom" in tainted[urandom]
    (small,) = _lines(script, "torch.manual_seed(seed)")
    assert "random.randint before anything seeded that RNG" in tainted[small]
    # the constants (after random.randint returned 42 and 4821) are not reported
    assert _lines(script, "torch.manual_seed(42)")[0] not in tainted
    # control: the same draws once their RNGs are seeded, and no clock
    report = _audit(capsys, _rel(script), "seeded")
    assert [f for f in report["findings"] if f["code"] == "TR305"] == []


def test_switches_set_only_on_cuda_are_read_from_the_source(capsys: pytest.CaptureFixture[str]) -> None:
    script = SCRIPTS / "cuda_branch.py"
    switches = ("TR203", "TR204", "TR205", "TR206")
    report = _audit(capsys, _rel(script))
    found = {(f["code"], f["location"]): f for f in report["findings"] if f["code"] in switches}
    (benchmark,) = _lines(script, "cudnn.benchmark = True")
    (tf32,) = _lines(script, "matmul.allow_tf32 = True")
    (precision,) = _lines(SCRIPTS / "cuda_branch_setup.py", "set_float32_matmul_precision")
    assert {(code, where, f["severity"]) for (code, where), f in found.items()} == {
        ("TR203", benchmark, "warning"),
        ("TR204", tf32, "info"),
        ("TR204", precision, "info"),  # an imported module of the script's own directory
    }
    message = found[("TR203", benchmark)]["message"]
    line = benchmark.rpartition(":")[2]
    assert f"on a branch not taken in this run: line {line}, under `if torch.cuda.is_available()" in message
    assert "under `if fast`" in found[("TR204", precision)]["message"]
    # control: the same lines run, and each setting is reported once, by what ran
    report = _audit(capsys, _rel(script), "everywhere")
    found_codes = sorted((f["code"], f["location"]) for f in report["findings"] if f["code"] in switches)
    assert found_codes == [("TR203", None), ("TR204", None)]
