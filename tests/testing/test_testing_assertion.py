"""``assert_reproducible`` on real runs: a pass, a divergence named by step/op/line, inconclusive as a
failure, function targets, and the refusals made before anything starts."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import ROOT, user_env
from torchrepro.errors import LaunchError, ReproAssertionError
from torchrepro.testing import assert_reproducible

SCRIPTS = ROOT / "tests" / "e2e" / "scripts"


def train_linear(steps: int) -> None:
    """A module-level training function: what a function target runs in each fresh process."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()


def train_at(steps: int, lr: float = 0.1) -> None:
    """A function with a keyword argument that a variant can change."""
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()


def train_from_entropy(steps: int) -> None:
    """Seeds itself from the OS after torchrepro did: each process starts from other weights."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    train_linear(steps)


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test runs checks as a user would, from ``tmp_path``, with this checkout's code."""
    for name in [n for n in os.environ if n.startswith("TORCHREPRO_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", user_env()["PYTHONPATH"])
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_reproducible_module_passes_and_returns_its_verdict(user_dir: Path) -> None:
    shutil.copy(SCRIPTS / "unseeded.py", user_dir / "train_unseeded.py")
    result = assert_reproducible("-m train_unseeded", root=user_dir / "checks")
    assert result.reproducible is True and result.steps_compared == 4
    assert Path(result.check_dir).parent == user_dir / "checks"


def test_a_script_that_is_not_reproducible_raises_with_the_step_op_and_line(user_dir: Path) -> None:
    script = shutil.copy(SCRIPTS / "threads_layernorm.py", user_dir / "train.py")
    line = 1 + Path(script).read_text().splitlines().index("    model(x).pow(2).mean().backward()")
    with pytest.raises(ReproAssertionError) as caught:
        assert_reproducible("train.py", vary=["hashseed", "threads"], root="checks")
    message = str(caught.value)
    first = message.splitlines()[0]
    assert first.startswith(
        "train.py (vary='threads'): NOT reproducible: first divergence: compute at step 0"
    )
    assert "op aten.native_layer_norm_backward" in first and f"location train.py:{line}" in first
    assert "varied: 1 vs 2 threads" in message and "events compared:" in message
    assert "records: checks/" in message
    # the first vary value passed; the check stopped at the one that failed
    assert caught.value.varied == ("hashseed", "threads")
    assert [r.reproducible for r in caught.value.results] == [True, False]
    assert isinstance(caught.value, AssertionError)


def test_an_inconclusive_check_fails_with_its_reason(user_dir: Path) -> None:
    shutil.copy(SCRIPTS / "zero_steps.py", user_dir / "evaluate.py")
    with pytest.raises(ReproAssertionError, match=r"(?s)INCONCLUSIVE: nothing that changes during training"):
        assert_reproducible("evaluate.py", root="checks")


def test_a_function_target_runs_in_fresh_processes(user_dir: Path) -> None:
    result = assert_reproducible(train_linear, 3, root="checks")
    assert result.reproducible is True and result.steps_compared == 3
    with pytest.raises(ReproAssertionError) as caught:  # negative control: the check can fail here
        assert_reproducible(train_from_entropy, 3, root="checks")
    assert str(caught.value).startswith(
        "test_testing_assertion.train_from_entropy(3): NOT reproducible: first divergence: init at step 0"
    )


def test_a_variant_of_a_function_is_compared_against_the_plain_call(user_dir: Path) -> None:
    """``vary={"lr": ...}``: the later runs call the function with that keyword argument."""
    same = assert_reproducible(train_at, 2, vary={"lr": 0.1}, root="checks", locate=False)
    assert same.reproducible is True and same.varied == "lr=0.1 in the later runs"
    with pytest.raises(ReproAssertionError) as caught:  # negative control: a variant that differs
        assert_reproducible(train_at, 2, vary={"lr": 0.2}, root="checks", locate=False)
    first = str(caught.value).splitlines()[0]
    assert first.startswith("test_testing_assertion.train_at(2) (vary={'lr': 0.2}): NOT reproducible")
    assert "compute at step 0" in first and "varied: lr=0.2 in the later runs" in str(caught.value)


def test_wrong_targets_and_options_are_refused_before_anything_starts(user_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*'sed'.*options are steps, vary, runs"):
        assert_reproducible("train.py", sed=1)
    with pytest.raises(ValueError, match=r"a module target is '-m package\.module'"):
        assert_reproducible("-m pkg.train --epochs 2")
    with pytest.raises(TypeError, match="argument 2 of a script or module target is its command line"):
        assert_reproducible("train.py", "--epochs", [2])
    with pytest.raises(LaunchError, match=r"script not found: 'missing\.py'"):
        assert_reproducible("missing.py")
    with pytest.raises(ValueError, match="vary must be None, a setting's name, a dict"):
        assert_reproducible(train_linear, vary=[])
    with pytest.raises(TypeError, match="vary as a dict compares a function called with those keyword"):
        assert_reproducible("train.py", vary={"resume_at": 3})
    assert list(user_dir.iterdir()) == []  # nothing was started or written
