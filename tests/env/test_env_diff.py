"""load_env / diff_env: files loaded or refused naming them, and how differences are classed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from torchrepro import EnvFileError, Environment, collect_env, diff_env, load_env
from torchrepro.env.diff import _DEFAULT_RULE, _RULES, _classify, _flatten


@pytest.fixture(scope="module")
def env() -> Environment:
    return collect_env()


# --- load -----------------------------------------------------------------------------------------


def test_load_env_accepts_bare_wrapped_and_record_directories(env: Environment, tmp_path: Path) -> None:
    data = env.to_dict()
    bare = tmp_path / "env.json"
    bare.write_text(json.dumps(data))
    wrapped = tmp_path / "run.json"
    wrapped.write_text(json.dumps({"command": ["python", "x.py"], "env": data}))
    assert load_env(bare) == env
    assert load_env(str(wrapped)) == env
    assert load_env(tmp_path) == env  # a run-record directory holds env.json


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"x": 1}', "not a torchrepro environment"),
        ('{"torch_version": "2.4.0", "num_threads": "two"}', "'num_threads' must be int"),
        ('{"torch_version": 2.4}', "'torch_version' must be str"),
    ],
)
def test_load_env_errors_name_the_file(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(EnvFileError, match=message) as info:
        load_env(path)
    assert str(path) in str(info.value)


# --- diff -----------------------------------------------------------------------------------------

BASE = Environment(
    collected_at="2026-01-01T00:00:00+00:00",
    hostname="alpha",
    python_version="3.11.7",
    python_executable="/usr/bin/python3",
    torch_version="2.4.0",
    cpu_capability="AVX512",
    cpu_count=32,
    num_threads=8,
    num_interop_threads=8,
    gpus=[{"name": "NVIDIA H100", "capability": "9.0", "memory_mb": 81559}],
    determinism={"deterministic_algorithms": True, "fp32_precision": {"cudnn.conv": "tf32"}},
    env_vars={"PYTHONHASHSEED": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "OMP_NUM_THREADS": "8"},
    packages={"numpy": "2.0.0", "tqdm": "4.0.0"},
    git_commit="a" * 40,
    git_changes={"README.md": "1" * 64},
)


@pytest.mark.parametrize(
    ("change", "key", "breaks"),
    [
        ({"torch_version": "2.5.0"}, "torch_version", True),
        ({"python_version": "3.12.0"}, "python_version", True),
        ({"python_version": "3.11.9"}, "python_version", False),
        ({"cpu_capability": "AVX2"}, "cpu_capability", True),
        ({"num_threads": 4}, "num_threads", True),
        ({"env_vars": {**BASE.env_vars, "OMP_NUM_THREADS": "4"}}, "env_vars.OMP_NUM_THREADS", True),
        ({"env_vars": {**BASE.env_vars, "PYTHONHASHSEED": None}}, "env_vars.PYTHONHASHSEED", True),
        (
            {"env_vars": {**BASE.env_vars, "CUBLAS_WORKSPACE_CONFIG": None}},
            "env_vars.CUBLAS_WORKSPACE_CONFIG",
            True,
        ),
        ({"env_vars": {**BASE.env_vars, "NCCL_ALGO": "Tree"}}, "env_vars.NCCL_ALGO", True),
        (
            {"determinism": {"deterministic_algorithms": False, "fp32_precision": {"cudnn.conv": "tf32"}}},
            "determinism.deterministic_algorithms",
            True,
        ),
        (
            {"determinism": {"deterministic_algorithms": True, "fp32_precision": {"cudnn.conv": "ieee"}}},
            "determinism.fp32_precision.cudnn.conv",
            True,
        ),
        ({"gpus": [{"name": "NVIDIA H200", "capability": "9.0", "memory_mb": 81559}]}, "gpus[0].name", True),
        ({"packages": {"numpy": "2.1.0", "tqdm": "4.0.0"}}, "packages.numpy", True),
        ({"git_commit": "b" * 40}, "git_commit", True),
        ({"git_changes": {"README.md": "1" * 64, "model.py": "2" * 64}}, "git_changes.model.py", True),
        ({"hostname": "beta"}, "hostname", False),
        ({"collected_at": "2026-02-02T00:00:00+00:00"}, "collected_at", False),
        ({"python_executable": "/opt/py/bin/python"}, "python_executable", False),
        ({"cpu_count": 64}, "cpu_count", False),
        ({"num_interop_threads": 2}, "num_interop_threads", False),
        (
            {"gpus": [{"name": "NVIDIA H100", "capability": "9.0", "memory_mb": 1}]},
            "gpus[0].memory_mb",
            False,
        ),
        ({"packages": {"numpy": "2.0.0", "tqdm": "4.1.0"}}, "packages.tqdm", False),
        (
            {"env_vars": {**BASE.env_vars, "CUDA_VISIBLE_DEVICES": "3"}},
            "env_vars.CUDA_VISIBLE_DEVICES",
            False,
        ),
        ({"env_vars": {**BASE.env_vars, "NCCL_DEBUG": "INFO"}}, "env_vars.NCCL_DEBUG", False),
        ({"git_changes": {"README.md": "3" * 64}}, "git_changes.README.md", False),
    ],
)
def test_each_difference_is_classed(change: dict[str, Any], key: str, breaks: bool) -> None:
    other = dataclasses.replace(BASE, **change)
    (d,) = diff_env(BASE, other)
    assert (d.key, d.breaks) == (key, breaks)
    assert d.reason and "\n" not in d.reason
    assert d.to_dict() == {"key": key, "a": d.a, "b": d.b, "breaks": breaks, "reason": d.reason}


def test_breaking_differences_come_first_with_one_reason_per_class() -> None:
    other = dataclasses.replace(
        BASE, hostname="beta", num_threads=1, env_vars={**BASE.env_vars, "OMP_NUM_THREADS": "1"}
    )
    diffs = diff_env(BASE, other)
    assert [d.breaks for d in diffs] == [True, True, False]
    assert diffs[0].reason == diffs[1].reason  # both are thread counts


def test_every_collected_field_has_a_specific_rule(env: Environment) -> None:
    flat: dict[str, Any] = {}
    _flatten(env.to_dict(), "", flat)
    flat.update({"gpus[0].name": 1, "gpus[0].capability": 1, "gpus[0].memory_mb": 1, "gpus.count": 1})
    unclassified = [k for k in flat if _classify(k) == _DEFAULT_RULE]
    assert unclassified == []
    assert all(reason and "\n" not in reason for _, _, reason in _RULES)


def test_portable_modes_variables_are_named_for_what_they_do() -> None:
    """MKL_CBWR and oneDNN's switch have reasons of their own (not the generic BLAS or switch one)."""
    portable = dataclasses.replace(
        BASE,
        env_vars={**BASE.env_vars, "MKL_CBWR": "AVX2,STRICT"},
        determinism={**BASE.determinism, "mkldnn_enabled": False},
    )
    plain = dataclasses.replace(BASE, determinism={**BASE.determinism, "mkldnn_enabled": True})
    found = {d.key: d for d in diff_env(plain, portable)}
    assert found.keys() == {"env_vars.MKL_CBWR", "determinism.mkldnn_enabled"}
    assert all(d.breaks for d in found.values())
    assert "STRICT makes its GEMMs the same for any thread count" in found["env_vars.MKL_CBWR"].reason
    assert "splits reductions by thread" in found["determinism.mkldnn_enabled"].reason
    # control: another MKL variable keeps the generic reason
    other = dataclasses.replace(BASE, env_vars={**BASE.env_vars, "MKL_DYNAMIC": "FALSE"})
    (d,) = diff_env(BASE, other)
    assert d.reason.startswith("BLAS and OpenMP settings")
