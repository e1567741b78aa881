"""The pytest plugin as a user's project meets it: loaded through the entry point pyproject.toml
declares, off with ``-p no:torchrepro``, the marker (pass, fail, inconclusive, a parametrized test
method), the fixture, ``--torchrepro-report``; no torch until a test uses it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, SRC, user_env

TRAINING = """
import pytest
import torch
from torch import nn


def train_small(steps, width=16):
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()


def train_layernorm(steps):
    # LayerNorm's backward on the CPU splits a reduction by the thread count
    model = nn.Sequential(nn.Linear(64, 4096), nn.LayerNorm(4096), nn.Linear(4096, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 64)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()  # the located line
        opt.step()


@pytest.mark.reproducible(steps=2)
def test_reproducible():
    train_small(3)


def train_resumable(steps):
    # checkpoints after every step (model, optimizer, RNG) and resumes from it: exact
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    done = 0
    if Path("ckpt.pt").exists():
        state = torch.load("ckpt.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        done = state["done"]
        torch.set_rng_state(state["rng"])
    for step in range(done, steps):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "done": step + 1}
        torch.save({**state, "rng": torch.get_rng_state()}, "ckpt.pt")


@pytest.mark.reproducible(vary="resume", resume_at=2)
def test_resumes():
    train_resumable(4)


@pytest.mark.reproducible(vary="threads")
def test_depends_on_threads():
    train_layernorm(2)


@pytest.mark.reproducible()
def test_trains_nothing():
    torch.zeros(3).sum()


class TestSuite:
    @pytest.mark.reproducible(steps=1)
    @pytest.mark.parametrize("width", [4])
    def test_width(self, width):
        train_small(2, width)


def test_fixture(torchrepro, tmp_path):
    result = torchrepro.assert_reproducible(train_small, 2)
    assert result.reproducible and Path(result.check_dir).is_relative_to(tmp_path)


from pathlib import Path
"""

LIGHT = """
import sys


def test_the_plugin_imported_nothing_heavy():
    assert "torch" not in sys.modules and "torchrepro.check" not in sys.modules


def test_the_fixture_is_there_and_needs_no_torch(torchrepro):
    assert type(torchrepro).__name__ == "Checker"
    assert "torch" not in sys.modules  # the check's parent process never imports it
"""

MARKED = """
import os
from pathlib import Path

import pytest


@pytest.mark.reproducible()
def test_marked():
    Path("ran-in").write_text(str(os.getpid()))
"""


def _entry_points() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(data["project"]["entry-points"]["pytest11"])


def test_pyproject_declares_the_plugin_entry_point() -> None:
    assert _entry_points() == {"torchrepro": "torchrepro.testing.plugin"}


def _project(tmp_path: Path, **files: str) -> Path:
    """A user's project, and a site directory installing the entry points pyproject.toml declares
    (as ``pip install`` does: a dist-info with ``entry_points.txt``), first on ``PYTHONPATH``."""
    site = tmp_path / "site" / "torchrepro_entry_points-0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: torchrepro-entry-points\nVersion: 0\n")
    lines = [f"{name} = {value}" for name, value in _entry_points().items()]
    (site / "entry_points.txt").write_text("[pytest11]\n" + "\n".join(lines) + "\n")
    project = tmp_path / "project"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\n")
    for name, text in files.items():
        (project / f"{name}.py").write_text(text)
    return project


def _pytest(project: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = user_env(drop=("PYTEST_",))
    env["PYTHONPATH"] = f"{project.parent / 'site'}:{SRC}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args]
    return subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_entry_point_loads_the_plugin_without_torch_and_no_torchrepro_turns_it_off(
    tmp_path: Path,
) -> None:
    project = _project(tmp_path, test_light=LIGHT, test_marked=MARKED)
    on = _pytest(project, "-W", "error", "test_light.py")
    assert on.returncode == 0, on.stdout + on.stderr
    off = _pytest(project, "-p", "no:torchrepro")
    assert "fixture 'torchrepro' not found" in off.stdout, off.stdout
    # the marker means nothing without the plugin: the test body ran in pytest's own process
    assert "2 passed, 1 warning, 1 error" in off.stdout, off.stdout
    assert (project / "ran-in").exists()


@pytest.mark.slow
def test_marked_tests_pass_fail_and_leave_a_report_per_failure(tmp_path: Path) -> None:
    project = _project(tmp_path, test_training=TRAINING)
    reports = tmp_path / "reports"
    proc = _pytest(project, "--strict-markers", "-W", "error", "-rA", "--torchrepro-report", str(reports))
    out = proc.stdout
    assert "2 failed, 4 passed" in out, out + proc.stderr
    assert "PASSED test_training.py::test_reproducible" in out
    assert "PASSED test_training.py::test_resumes" in out  # killed after step 2, resumed exactly
    assert "PASSED test_training.py::TestSuite::test_width[4]" in out
    assert "PASSED test_training.py::test_fixture" in out
    failed = "test_training.py::test_depends_on_threads (vary='threads'): NOT reproducible: first divergence:"
    assert f"{failed} compute at step 0" in out
    assert "INCONCLUSIVE: nothing that changes during training was compared" in out
    assert f"torchrepro: 2 reports of failed checks in {reports}" in out
    # one report per failing test, named after its id
    names = sorted(p.name for p in reports.iterdir())
    stems = sorted({Path(n).stem for n in names})
    assert [s.rsplit("-", 1)[0] for s in stems] == [
        "test_training.py_test_depends_on_threads",
        "test_training.py_test_trains_nothing",
    ]
    assert names == [f"{stem}{suffix}" for stem in stems for suffix in (".html", ".json", ".txt")]
    names = [n for n in names if not n.endswith(".html")]
    report = json.loads((reports / names[0]).read_text())
    assert report["test"] == "test_training.py::test_depends_on_threads"
    (check,) = report["checks"]
    assert check["vary"] == "threads" and check["reproducible"] is False
    divergence = check["first_divergence"]
    assert divergence["step"] == 0 and divergence["op"] == "aten.native_layer_norm_backward.default"
    line = 1 + TRAINING.splitlines().index("        model(x).pow(2).mean().backward()  # the located line")
    assert divergence["location"] == f"test_training.py:{line}"
    text = (reports / names[1]).read_text()
    assert (
        text.startswith("test_training.py::test_depends_on_threads\n") and f"test_training.py:{line}" in text
    )
    page = (reports / f"{stems[0]}.html").read_text()
    assert "NOT REPRODUCIBLE" in page and f"test_training.py:{line}" in page and 'id="distance-plot"' in page
    inconclusive = json.loads((reports / names[2]).read_text())
    assert inconclusive["checks"][0]["inconclusive"] is True
