"""collect_env: what is collected (torch, environment variables, git, GPUs), read-only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrepro
from torchrepro import Environment, collect_env, diff_env
from torchrepro.env import collect as collect_module


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
    # CUDA as this process has it (an earlier test may have started it on a GPU machine), and
    # collecting never starts it
    started = torch.cuda.is_initialized()
    assert env.cuda_initialized is started
    assert collect_env().cuda_initialized is started and torch.cuda.is_initialized() is started


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
    # nvidia-smi is asked while CUDA has not started (after, torch names the devices): on a machine
    # with a GPU an earlier test in this process may have started it
    monkeypatch.setattr(collect_module, "cuda_started", lambda: False)
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
