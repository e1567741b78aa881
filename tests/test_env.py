"""collect_env / load_env / diff_env: what is collected, round trips, and how differences are classed."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrepro
from torchrepro import EnvFileError, Environment, collect_env, diff_env, load_env
from torchrepro.env import _DEFAULT_RULE, _RULES, _classify, _flatten


@pytest.fixture(scope="module")
def env() -> Environment:
    return collect_env()


def breaking(a: Environment, b: Environment) -> dict[str, Any]:
    return {d.key: (d.a, d.b) for d in diff_env(a, b) if d.breaks}


# --- collect --------------------------------------------------------------------------------------


def test_collects_the_values_torch_reports(env: Environment) -> None:
    assert env.torch_version == torch.__version__
    assert env.torch_git_version == torch.version.git_version
    assert env.python_version == ".".join(map(str, sys.version_info[:3]))
    assert env.cpu_capability == torch.backends.cpu.get_cpu_capability()
    assert env.num_threads == torch.get_num_threads()
    assert env.cuda_version == torch.version.cuda
    assert env.torchrepro_version == torchrepro.__version__
    assert env.hash_randomization == bool(sys.flags.hash_randomization)
    assert env.torch_build and "BLAS_INFO" in env.torch_build
    assert env.packages is not None and "numpy" in env.packages
    assert env.determinism is not None
    assert env.determinism["deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()
    assert env.determinism["mkldnn_enabled"] == torch.backends.mkldnn.enabled
    assert env.env_vars is not None
    for name in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY"):
        assert name in env.env_vars
    assert env.cuda_initialized is False and not torch.cuda.is_initialized()  # never started by collect


def test_to_dict_is_json_and_round_trips(env: Environment) -> None:
    data = json.loads(json.dumps(env.to_dict()))
    again = Environment.from_dict(data)
    assert again == env
    assert diff_env(env, again) == []


def test_environment_variables_are_read_and_secrets_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("TORCH_HUB_TOKEN", "do-not-record")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    got = collect_env().env_vars
    assert got is not None
    assert got["OMP_NUM_THREADS"] == "3" and got["NCCL_ALGO"] == "Ring"
    assert "TORCH_HUB_TOKEN" not in got and "UNRELATED_VARIABLE" not in got


def test_thread_count_and_switches_are_seen_as_breaking(env: Environment) -> None:
    # negative control: collecting again with nothing changed differs only harmlessly
    assert breaking(env, collect_env()) == {}
    threads = torch.get_num_threads()
    benchmark = torch.backends.cudnn.benchmark
    try:
        torch.set_num_threads(threads + 1)
        torch.backends.cudnn.benchmark = not benchmark
        changed = collect_env()
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark
    got = breaking(env, changed)
    assert got["num_threads"] == (threads, threads + 1)
    assert got["determinism.cudnn_benchmark"] == (benchmark, not benchmark)


def git(cwd: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_git_commit_changes_and_script_digest(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    script = repo / "train.py"
    script.write_text("print('v1')\n")
    (repo / "README.md").write_text("docs\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    clean = collect_env(script=str(script))
    assert clean.git_commit == git(repo, "rev-parse", "HEAD")
    assert clean.git_root is not None and Path(clean.git_root).resolve() == repo.resolve()
    assert clean.git_dirty is False and clean.git_changes == {}
    assert clean.script == str(script.resolve()) and clean.script_sha256 is not None

    (repo / "README.md").write_text("more docs\n")
    docs_only = collect_env(script=str(script))
    assert docs_only.git_dirty is True and set(docs_only.git_changes or {}) == {"README.md"}
    assert breaking(clean, docs_only) == {}  # an edit to documentation is harmless

    script.write_text("print('v2')\n")
    edited = collect_env(script=str(script))
    got = breaking(docs_only, edited)
    assert set(got) == {"script_sha256", "git_changes.train.py"}

    outside = tmp_path / "plain"
    outside.mkdir()
    (outside / "s.py").write_text("")
    no_repo = collect_env(script=str(outside / "s.py"))
    assert (no_repo.git_root, no_repo.git_commit, no_repo.git_dirty) == (None, None, None)


def test_gpus_from_nvidia_smi_respect_cuda_visible_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        "echo '0, GPU-aaa, NVIDIA H100 80GB HBM3, 9.0, 550.54.15, 81559'\n"
        "echo '1, GPU-bbb, NVIDIA A100-SXM4-40GB, 8.0, 550.54.15, 40960'\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    both = collect_env()
    assert both.gpu_driver == "550.54.15"
    assert both.gpus == [
        {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_mb": 81559},
        {"name": "NVIDIA A100-SXM4-40GB", "capability": "8.0", "memory_mb": 40960},
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    second = collect_env()
    assert [g["name"] for g in second.gpus or []] == ["NVIDIA A100-SXM4-40GB"]
    got = breaking(both, second)
    assert got["gpus.count"] == (2, 1) and got["gpus[0].name"] == (
        "NVIDIA H100 80GB HBM3",
        "NVIDIA A100-SXM4-40GB",
    )
    assert "env_vars.CUDA_VISIBLE_DEVICES" not in got  # harmless by itself: the models are compared


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


def test_older_and_newer_files_load() -> None:
    old = Environment.from_dict({"torch_version": "2.4.0", "python_version": "3.10.1"})
    assert old.num_threads is None and old.extra == {}
    newer = Environment.from_dict({"torch_version": "2.4.0", "future_field": {"x": 1}})
    assert newer.extra == {"future_field": {"x": 1}}
    assert newer.to_dict()["future_field"] == {"x": 1}
    (d,) = diff_env(old, dataclasses.replace(old, extra={"future_field": 1}))
    assert (d.key, d.breaks) == ("future_field", False)


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
