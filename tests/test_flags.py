"""set_determinism, DeterminismFlags, reproducible and status: every mode, round trips, bad input."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import torchrepro
from torchrepro import DeterminismError, DeterminismFlags, ReproWarning, _runtime, set_determinism, status
from torchrepro import errors as errors_module
from torchrepro.flags import CUBLAS_VAR, FLASH_ATTENTION_VAR
from torchrepro.seeding import current_seed

B = torch.backends


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> Iterator[DeterminismFlags]:
    """Start with CUBLAS_WORKSPACE_CONFIG unset in a process where CUDA has not started; put every
    switch back afterwards. (On a machine with a GPU an earlier test in this process may have
    started CUDA, and strict mode then refuses to run without the variable: torchrepro's own check
    is pinned to "not started", as test_cuda_started_without_cublas_var pins it to "started".)"""
    monkeypatch.setattr(_runtime, "cuda_started", lambda: False)
    monkeypatch.delenv(CUBLAS_VAR, raising=False)
    monkeypatch.delenv(FLASH_ATTENTION_VAR, raising=False)
    monkeypatch.setattr(errors_module, "_warned", set())  # let warn_once warn again in this test
    before = DeterminismFlags.capture()
    yield before
    before.restore()


STRICT = {
    "deterministic_algorithms": True,
    "warn_only": False,
    "cudnn_deterministic": True,
    "cudnn_benchmark": False,
    "cuda_matmul_allow_tf32": False,
    "cudnn_allow_tf32": False,
    "float32_matmul_precision": "highest",
    "fill_uninitialized_memory": True,
    "cublas_workspace_config": ":4096:8",
    "flash_attention_deterministic": "1",
}


@pytest.mark.parametrize("mode", ["strict", "warn"])
def test_strict_and_warn_set_every_switch(saved: DeterminismFlags, mode: str) -> None:
    messy()
    set_determinism(mode)
    got = DeterminismFlags.capture().to_dict()
    assert {k: got[k] for k in STRICT} == {**STRICT, "warn_only": mode == "warn"}
    assert all(v in ("none", "ieee") for v in got["fp32_precision"].values())
    assert status().mode == mode


def messy() -> None:
    """Switches as a speed-minded user leaves them."""
    torch.use_deterministic_algorithms(False)
    B.cudnn.benchmark = True
    torch.set_float32_matmul_precision("medium")
    B.cudnn.allow_tf32 = True
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def test_set_determinism_returns_the_previous_flags(saved: DeterminismFlags) -> None:
    messy()
    before = DeterminismFlags.capture()
    previous = set_determinism("strict")
    assert previous == before
    assert previous.cublas_workspace_config is None
    assert os.environ[FLASH_ATTENTION_VAR] == "1"
    previous.restore()
    assert DeterminismFlags.capture() == before
    assert CUBLAS_VAR not in os.environ and FLASH_ATTENTION_VAR not in os.environ


def test_off_is_pytorch_defaults(saved: DeterminismFlags) -> None:
    code = "import json, torchrepro; print(json.dumps(torchrepro.DeterminismFlags.capture().to_dict()))"
    env = {k: v for k, v in os.environ.items() if k != CUBLAS_VAR}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    fresh = json.loads(child.stdout)
    set_determinism("strict")
    messy()
    set_determinism("off")
    got = DeterminismFlags.capture().to_dict()
    for variable in ("cublas_workspace_config", "flash_attention_deterministic"):
        got.pop(variable)  # off leaves the variables as they are
        fresh.pop(variable)
    assert got == fresh
    assert status().mode == "off"


def test_valid_cublas_value_is_kept(saved: DeterminismFlags, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUBLAS_VAR, ":16:8")
    previous = set_determinism("strict")
    assert os.environ[CUBLAS_VAR] == ":16:8"
    assert previous.cublas_workspace_config == ":16:8"


def test_invalid_cublas_value_raises_in_strict_and_changes_nothing(
    saved: DeterminismFlags, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CUBLAS_VAR, ":4096:2")
    before = DeterminismFlags.capture()
    with pytest.raises(DeterminismError, match=r"':4096:2'.*':4096:8' or ':16:8'"):
        set_determinism("strict")
    assert DeterminismFlags.capture() == before


def test_invalid_cublas_value_warns_in_warn_mode(
    saved: DeterminismFlags, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CUBLAS_VAR, "4096")
    with pytest.warns(ReproWarning, match=r":4096:8.*:16:8"):
        set_determinism("warn")
    assert os.environ[CUBLAS_VAR] == "4096"
    assert torch.is_deterministic_algorithms_warn_only_enabled()


def test_cuda_started_without_cublas_var(saved: DeterminismFlags, monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU machine cannot start CUDA; pretend it has started (only torchrepro's own check is patched).
    monkeypatch.setattr(_runtime, "cuda_started", lambda: True)
    before = DeterminismFlags.capture()
    with pytest.raises(DeterminismError, match=r"CUDA is already initialised.*before the process starts"):
        set_determinism("strict")
    assert DeterminismFlags.capture() == before
    with pytest.warns(ReproWarning, match="CUDA is already initialised"):
        set_determinism("warn")
    assert os.environ[CUBLAS_VAR] == ":4096:8"
    report = status()
    assert not report.deterministic  # warn-only
    del os.environ[CUBLAS_VAR]  # the fixture restores it (monkeypatch would put it back)
    assert not status()["cuda_initialized"].ok


@pytest.mark.parametrize(("mode", "error"), [("STRICT", ValueError), ("fast", ValueError), (True, TypeError)])
def test_unknown_mode(saved: DeterminismFlags, mode: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"\['strict', 'warn', 'off'\]"):
        set_determinism(mode)  # type: ignore[arg-type]
    with pytest.raises(error, match=r"\['strict', 'warn', 'off'\]"), torchrepro.reproducible(0, mode):  # type: ignore[arg-type]
        pass
    assert DeterminismFlags.capture() == saved


def test_flags_round_trip_through_random_changes(saved: DeterminismFlags) -> None:
    """Random mixes of legacy and per-backend precision calls; restore puts back what was read."""
    seed = 20261122
    print(f"seed {seed}")
    rng = random.Random(seed)
    # the per-backend precision tree exists on newer torch only (torch 2.4 has the legacy switches)
    nodes: list[object] = []
    if hasattr(B, "fp32_precision"):
        nodes = [B, B.cuda.matmul, B.cudnn, B.mkldnn]
        nodes += [getattr(n, leaf) for n, leaf in ((B.cudnn, "conv"), (B.cudnn, "rnn"), (B.mkldnn, "matmul"))]

    def change() -> None:
        choice = rng.randrange(8)
        if choice == 0:
            torch.set_float32_matmul_precision(rng.choice(["highest", "high", "medium"]))
        elif choice == 1:
            B.cudnn.allow_tf32 = rng.random() < 0.5
        elif choice == 2:
            torch.use_deterministic_algorithms(rng.random() < 0.5, warn_only=rng.random() < 0.5)
        elif choice == 3:
            B.cudnn.benchmark = rng.random() < 0.5
            B.cudnn.deterministic = rng.random() < 0.5
        elif choice == 4:
            torch.utils.deterministic.fill_uninitialized_memory = rng.random() < 0.5  # type: ignore[attr-defined]
        elif choice == 5:
            if rng.random() < 0.5:
                os.environ[CUBLAS_VAR] = rng.choice([":4096:8", ":16:8", "junk"])
            else:
                os.environ.pop(CUBLAS_VAR, None)
        elif nodes:
            node = rng.choice(nodes)
            with contextlib.suppress(RuntimeError, ValueError):  # not every backend takes every value
                node.fp32_precision = rng.choice(["none", "ieee", "tf32", "bf16"])

    checked = 0
    for _ in range(150):
        for _ in range(rng.randrange(4)):
            change()
        snapshot = DeterminismFlags.capture()
        for _ in range(rng.randrange(1, 5)):
            change()
        snapshot.restore()
        if None in (
            snapshot.float32_matmul_precision,
            snapshot.cuda_matmul_allow_tf32,
            snapshot.cudnn_allow_tf32,
        ):
            # PyTorch hides some legacy state once its two precision APIs are mixed; the switches
            # it does report must still come back.
            now = DeterminismFlags.capture()
            assert now.fp32_precision == snapshot.fp32_precision
            assert now.cublas_workspace_config == snapshot.cublas_workspace_config
            continue
        assert DeterminismFlags.capture() == snapshot
        checked += 1
    assert checked > 50
    os.environ.pop(CUBLAS_VAR, None)
    saved.restore()


def test_to_dict_is_json(saved: DeterminismFlags) -> None:
    d = DeterminismFlags.capture().to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["cublas_workspace_config"] is None


# --- reproducible ---


def test_reproducible_same_seed_same_draws_and_everything_restored(
    saved: DeterminismFlags, rng_changes_ok: None
) -> None:
    torchrepro.seed_everything(1)
    before_seed = current_seed()
    state = torchrepro.RngState.capture()
    outer = [random.random(), float(np.random.rand()), float(torch.rand(1))]
    state.restore()
    inside = []
    for _ in range(2):
        with torchrepro.reproducible(42) as seed:
            assert seed == 42 and current_seed() == 42
            assert status().deterministic
            assert os.environ[CUBLAS_VAR] == ":4096:8"
            inside.append([random.random(), float(np.random.rand()), float(torch.rand(1))])
        assert DeterminismFlags.capture() == saved
        assert CUBLAS_VAR not in os.environ
        assert current_seed() == before_seed
    assert inside[0] == inside[1]
    assert [random.random(), float(np.random.rand()), float(torch.rand(1))] == outer


def test_reproducible_restores_after_an_exception(saved: DeterminismFlags, rng_changes_ok: None) -> None:
    state = torchrepro.RngState.capture()
    expected = torch.rand(2)
    state.restore()
    with pytest.raises(ZeroDivisionError), torchrepro.reproducible(3, mode="warn"):
        torch.rand(100)
        1 / 0  # noqa: B018
    assert DeterminismFlags.capture() == saved
    assert torch.equal(torch.rand(2), expected)


@pytest.mark.parametrize(("seed", "error"), [(-1, ValueError), ("1", TypeError)])
def test_reproducible_bad_seed_changes_nothing(
    saved: DeterminismFlags, seed: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="seed must be"), torchrepro.reproducible(seed):  # type: ignore[arg-type]
        pass
    assert DeterminismFlags.capture() == saved


# --- status ---


def test_status_per_mode(saved: DeterminismFlags) -> None:
    set_determinism("strict")
    strict = status()
    assert strict.deterministic and strict.mode == "strict"
    assert all(item.ok for item in strict.items if not item.process_start)
    set_determinism("warn")
    warn = status()
    assert not warn.deterministic and warn.mode == "warn"
    assert [i.name for i in warn.shortfalls if not i.process_start] == ["warn_only"]
    assert "set_determinism('strict')" in warn["warn_only"].fix
    set_determinism("off")
    off = status()
    assert not off.deterministic and off.mode == "off"
    assert {"deterministic_algorithms", "cudnn.deterministic", "cudnn.allow_tf32"} <= {
        i.name for i in off.shortfalls
    }


def test_status_never_calls_warn_only_deterministic(saved: DeterminismFlags) -> None:
    set_determinism("strict")
    torch.use_deterministic_algorithms(True, warn_only=True)  # strict in every other switch
    report = status()
    assert not report.deterministic
    assert report.mode == "warn"
    assert not report["warn_only"].ok
    assert not report.to_dict()["deterministic"]


def test_status_items_fixes_and_json(saved: DeterminismFlags) -> None:
    report = status()
    d = report.to_dict()
    assert json.loads(json.dumps(d)) == d
    names = [item["name"] for item in d["items"]]
    for name in [
        "deterministic_algorithms",
        "warn_only",
        "cudnn.deterministic",
        "cudnn.benchmark",
        "cuda.matmul.allow_tf32",
        "cudnn.allow_tf32",
        "float32_matmul_precision",
        "fill_uninitialized_memory",
        CUBLAS_VAR,
        "PYTHONHASHSEED",
        "threads",
        "cpu_capability",
        "cuda_initialized",
    ]:
        assert name in names
    for item in report.items:
        assert (item.fix == "") == item.ok, item
        assert "\n" not in item.fix
    with pytest.raises(KeyError, match="no status item 'nope'"):
        report["nope"]


def test_status_process_start_settings(saved: DeterminismFlags, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PYTHONHASHSEED", "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    unpinned = status()
    if sys.flags.hash_randomization:
        assert not unpinned["PYTHONHASHSEED"].ok
        assert "PYTHONHASHSEED=0" in unpinned["PYTHONHASHSEED"].fix
    assert (
        not unpinned["threads"].ok and f"OMP_NUM_THREADS={torch.get_num_threads()}" in unpinned["threads"].fix
    )
    assert not unpinned["cpu_capability"].ok and "ATEN_CPU_CAPABILITY=" in unpinned["cpu_capability"].fix
    assert not unpinned.pinned
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", str(torch.backends.cpu.get_cpu_capability()).lower())
    pinned = status()
    assert pinned.pinned
    assert pinned["cuda_initialized"].value is False and pinned["cuda_initialized"].ok


def test_status_changes_nothing(saved: DeterminismFlags) -> None:
    cuda = torch.cuda.is_initialized()  # True where an earlier test started it (a GPU machine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status()
    assert DeterminismFlags.capture() == saved
    assert torch.cuda.is_initialized() is cuda


def test_strict_mode_does_not_import_inductor_but_inductor_still_compiles_deterministically() -> None:
    """torch.use_deterministic_algorithms imports Inductor (about a second of start-up) to set its
    deterministic mode; set_determinism gets the same effect without the import."""
    code = (
        "import sys, torch, torchrepro\n"
        "torchrepro.set_determinism('strict')\n"
        "before = 'torch._inductor.config' in sys.modules\n"
        "import torch._inductor.config as c\n"
        "print(before, torch.are_deterministic_algorithms_enabled(), getattr(c, 'deterministic', None))\n"
        "torchrepro.set_determinism('off')\n"
        "print(torch.are_deterministic_algorithms_enabled(), getattr(c, 'deterministic', None))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_DETERMINISTIC"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    if out.stdout.split("\n")[1] == "False None":
        pytest.skip(f"torch {torch.__version__}'s Inductor has no deterministic mode")
    assert out.stdout.split("\n")[:2] == ["False True True", "False False"]
    # the stock path imports it: the control that shows the check above can fail
    stock = (
        "import sys, torch\ntorch.use_deterministic_algorithms(True)\nprint('torch._inductor' in sys.modules)"
    )
    control = subprocess.run(
        [sys.executable, "-c", stock], env=env, capture_output=True, text=True, check=True
    )
    assert control.stdout.strip() == "True"


def test_the_status_table_names_each_setting_once_and_the_fix_of_each_shortfall(
    saved: DeterminismFlags,
) -> None:
    messy()
    report = status()
    text = str(report)
    lines = text.splitlines()
    assert lines[0].startswith(f"determinism: {report.mode}") and "not deterministic" in lines[0]
    for item in report.items:
        (row,) = [line for line in lines if line.split()[1:2] == [item.name]]
        assert row.split()[0] == ("ok" if item.ok else "NO")
        assert ("strict wants" in row) == (not item.ok)
    assert text.count("fix: ") == len(report.shortfalls)
    assert "cudnn.benchmark" in text and "call torchrepro.set_determinism('strict')" in text
    set_determinism("strict")
    strict = str(status())
    assert strict.splitlines()[0].startswith("determinism: strict mode (deterministic)")
    assert "NO  deterministic_algorithms" not in strict


def test_strict_mode_sets_fallback_random_without_importing_inductor() -> None:
    """Compiled random ops draw as eager's under strict mode: Inductor's ``fallback_random`` is set
    when its config is imported (set_determinism never imports it), recorded by ``capture`` before
    and after the import, and ``off`` puts back Inductor's default."""
    code = (
        "import sys, torch, torchrepro\n"
        "torchrepro.set_determinism('strict')\n"
        "before = 'torch._inductor.config' in sys.modules\n"
        "capture = torchrepro.DeterminismFlags.capture\n"
        "waiting = capture().inductor_fallback_random\n"
        "import torch._inductor.config as c\n"
        "print(before, waiting, c.fallback_random, capture().inductor_fallback_random)\n"
        "torchrepro.set_determinism('off')\n"
        "print(c.fallback_random)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["False True True True", "False"]
    # the control: plain PyTorch compiles with Inductor's own random numbers
    stock = "import torch._inductor.config as c\nprint(c.fallback_random)"
    control = subprocess.run([sys.executable, "-c", stock], capture_output=True, text=True, check=True)
    assert control.stdout.strip() == "False"


def test_fallback_random_is_restored_once_inductor_is_imported(saved: DeterminismFlags) -> None:
    import torch._inductor.config as inductor

    inductor.fallback_random = False
    previous = set_determinism("strict")
    assert inductor.fallback_random is True and DeterminismFlags.capture().inductor_fallback_random is True
    previous.restore()
    assert inductor.fallback_random is False
