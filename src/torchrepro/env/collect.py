"""Collecting this process's environment fingerprint: ``collect_env`` and its probes (the torch
build, GPUs, CPU model and flags, packages, git, environment variables).

Invariants:
- ``collect_env`` only reads: it never initialises CUDA (GPUs come from ``torch.cuda`` only when
  CUDA has already started in this process, otherwise from ``nvidia-smi``), never imports the
  packages whose versions it reports (``importlib.metadata``), never takes git's index lock, and
  bounds every subprocess with a short timeout. A value that cannot be collected is ``None``.
- What is collected is listed here once: the environment variables (secrets never), the compute
  and tooling packages (``diff`` classes the tooling ones as harmless), the CPU flags.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchrepro._runtime import cuda_started
from torchrepro._version import __version__
from torchrepro.env.model import Environment
from torchrepro.protocol import ENV_PREFIX, HASH_SEED_VAR, MKL_THREADS_VAR, OMP_THREADS_VAR

__all__ = ["collect_env"]

_SUBPROCESS_TIMEOUT_S = 2.0
_MAX_GIT_CHANGES = 200

# --- what is collected ------------------------------------------------------------------------

#: Environment variables always listed (``None`` when unset), then every variable with a prefix.
_ENV_VARS = (
    HASH_SEED_VAR,
    "CUBLAS_WORKSPACE_CONFIG",
    OMP_THREADS_VAR,
    MKL_THREADS_VAR,
    "ATEN_CPU_CAPABILITY",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_TF32_OVERRIDE",
)
_ENV_PREFIXES = (
    "CUBLAS",
    "CUDNN_",
    "CUDA_",
    "NCCL_",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "ONEDNN_",
    "DNNL_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    ENV_PREFIX,
    "NVIDIA_TF32",
)
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|_KEY$", re.IGNORECASE)

#: Packages whose code computes or transforms values (a version change can change results).
_COMPUTE_PACKAGES = frozenset(
    [
        "numpy",
        "scipy",
        "torchvision",
        "torchaudio",
        "torchtext",
        "torchdata",
        "torchrec",
        "triton",
        "pytorch-triton",
        "xformers",
        "flash-attn",
        "transformer-engine",
        "apex",
        "deepspeed",
        "accelerate",
        "transformers",
        "tokenizers",
        "datasets",
        "sentencepiece",
        "timm",
        "lightning",
        "pytorch-lightning",
        "lightning-fabric",
        "torchmetrics",
        "pillow",
        "pillow-simd",
        "opencv-python",
        "opencv-python-headless",
        "albumentations",
        "kornia",
        "scikit-learn",
        "pandas",
        "intel-extension-for-pytorch",
        "mkl",
        "onnxruntime",
        "jax",
        "jaxlib",
    ]
)
#: Tooling reported for context only (logging, configuration, progress bars).
TOOLING_PACKAGES = frozenset(["tensorboard", "wandb", "mlflow", "tqdm", "hydra-core", "omegaconf", "rich"])

#: CPU features that select different kernels in torch, oneDNN or MKL.
_CPU_FLAGS = frozenset(
    [
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512dq",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "avx_vnni",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
        "amx_fp16",
        "asimd",
        "asimdhp",
        "sve",
        "sve2",
        "bf16",
        "i8mm",
    ]
)


def collect_env(*, script: str | os.PathLike[str] | None = None) -> Environment:
    """Collect this process's environment fingerprint (read-only, well under a second).

    ``script``: the training script; its content digest and the git commit and uncommitted
    changes of its repository are recorded (without it, of the current directory's repository).
    """
    script_path = Path(script).resolve() if script is not None else None
    build = _torch_build()
    parallel = _parallel_info()
    gpu_driver, gpus, cuda_initialized = _gpus()
    cpu_model, cpu_flags = _cpuinfo()
    git_dir = script_path.parent if script_path is not None else Path.cwd()
    git_root, git_commit, git_dirty, git_changes = _git(git_dir)
    return Environment(
        collected_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        hostname=_safe(socket.gethostname),
        python_version=platform.python_version(),
        python_implementation=platform.python_implementation(),
        python_executable=sys.executable or None,
        hash_randomization=bool(sys.flags.hash_randomization),
        platform=_safe(platform.platform),
        machine=platform.machine() or None,
        libc=_safe(lambda: " ".join(platform.libc_ver()).strip() or None),
        torchrepro_version=__version__,
        torch_version=str(torch.__version__),
        torch_git_version=getattr(torch.version, "git_version", None),
        torch_debug=bool(getattr(torch.version, "debug", False)),
        torch_build=build,
        cuda_version=torch.version.cuda,
        hip_version=getattr(torch.version, "hip", None),
        cudnn_version=_safe(_cudnn_version),
        nccl_version=_safe(_nccl_version),
        cuda_initialized=cuda_initialized,
        gpu_driver=gpu_driver,
        gpus=gpus,
        cpu_model=cpu_model,
        cpu_count=os.cpu_count(),
        cpu_capability=_safe(torch.backends.cpu.get_cpu_capability),
        cpu_flags=cpu_flags,
        num_threads=torch.get_num_threads(),
        num_interop_threads=_safe(torch.get_num_interop_threads),
        omp_max_threads=parallel.get("omp_get_max_threads()"),
        mkl_max_threads=parallel.get("mkl_get_max_threads()"),
        determinism=_determinism(),
        env_vars=_env_vars(),
        packages=_packages(),
        script=str(script_path) if script_path is not None else None,
        script_sha256=_safe(lambda: _file_sha256(script_path)) if script_path is not None else None,
        git_root=git_root,
        git_commit=git_commit,
        git_dirty=git_dirty,
        git_changes=git_changes,
    )


def _safe(fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``None`` when it fails: one uncollectable value never hides the others."""
    try:
        value = fn()
    except Exception:
        return None
    return None if value is None else value if isinstance(value, (bool, int, float, str)) else str(value)


def _run(args: list[str], cwd: Path | None = None) -> str | None:
    try:
        proc = subprocess.run(
            args,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_SUBPROCESS_TIMEOUT_S,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"},
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


_BUILD_LINE_KEYS = (
    ("Intel(R) oneAPI Math Kernel Library", "MKL"),
    ("Intel(R) Math Kernel Library", "MKL"),
    ("Intel(R) MKL-DNN", "oneDNN"),
    ("OpenMP", "OpenMP"),
    ("GCC", "compiler"),
    ("clang", "compiler"),
    ("MSVC", "compiler"),
)


def _torch_build() -> dict[str, Any] | None:
    """``torch.__config__.show()`` as a dict; the runtime CPU capability line is left out."""
    try:
        text = torch.__config__.show()
    except Exception:
        return None
    build: dict[str, Any] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith("- "):
            continue
        line = line[2:].strip()
        if line.startswith("Build settings:"):
            for item in line[len("Build settings:") :].split(", "):
                key, sep, value = item.partition("=")
                if sep and key.strip():
                    build[key.strip()] = value.strip().rstrip(",")
            continue
        if line.startswith("CPU capability usage"):
            continue  # the runtime ISA, reported as cpu_capability
        for prefix, key in _BUILD_LINE_KEYS:
            if line.startswith(prefix):
                build[key] = line
                break
        else:
            key, sep, value = line.partition(":")
            build[key.strip() if sep else line] = value.strip() if sep else "yes"
    return build


def _parallel_info() -> dict[str, int]:
    try:
        text = torch.__config__.parallel_info()
    except Exception:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition(" : ")
        if sep and value.strip().isdigit():
            out[key.strip()] = int(value)
    return out


def _cudnn_version() -> str | None:
    if not torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
        return None
    return str(torch.backends.cudnn.version())  # type: ignore[no-untyped-call]


def _nccl_version() -> str | None:
    if torch.version.cuda is None:
        return None
    nccl = importlib.import_module("torch.cuda.nccl")
    version = nccl.version()  # a library call; CUDA is not initialised
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _gpus() -> tuple[str | None, list[dict[str, Any]] | None, bool]:
    """(driver, visible GPUs, whether CUDA was initialised). Never initialises CUDA."""
    initialized = cuda_started()
    driver: str | None = None
    gpus: list[dict[str, Any]] | None = None
    smi = _run(
        [
            "nvidia-smi",
            "--query-gpu=index,uuid,name,compute_cap,driver_version,memory.total",
            "--format=csv,noheader,nounits",
        ]
    )
    if smi is not None:
        rows = [[c.strip() for c in line.split(",")] for line in smi.strip().splitlines() if line.strip()]
        rows = [r for r in rows if len(r) == 6]
        rows = _visible(rows)
        gpus = [
            {"name": r[2], "capability": r[3] or None, "memory_mb": int(r[5]) if r[5].isdigit() else None}
            for r in rows
        ]
        driver = rows[0][4] if rows else None
    if initialized:
        try:
            gpus = []
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                gpus.append(
                    {
                        "name": props.name,
                        "capability": f"{props.major}.{props.minor}",
                        "memory_mb": props.total_memory // (1 << 20),
                    }
                )
        except Exception:
            pass
    elif gpus is None and torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        gpus = []  # a CPU-only torch uses no GPU, whatever is installed
    return driver, gpus, initialized


def _visible(rows: list[list[str]]) -> list[list[str]]:
    """The nvidia-smi rows CUDA_VISIBLE_DEVICES leaves visible, in its order."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return rows
    out = []
    for item in (s.strip() for s in spec.split(",")):
        match = [r for r in rows if r[0] == item or (item and r[1].startswith(item))]
        if not match:
            break  # CUDA stops at the first invalid entry
        out.append(match[0])
    return out


def _cpuinfo() -> tuple[str | None, list[str] | None]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return (platform.processor() or None), None
    model: str | None = None
    flags: list[str] | None = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if not sep:
            if model is not None or flags is not None:
                break  # end of the first processor block
            continue
        if key in ("model name", "hardware", "cpu model") and model is None:
            model = value.strip()
        elif key in ("flags", "features") and flags is None:
            flags = sorted(set(value.split()) & _CPU_FLAGS)
    return model or platform.processor() or None, flags


def _determinism() -> dict[str, Any]:
    """Every switch that selects kernels or numerics (no CUDA initialisation)."""
    from torchrepro.flags import DeterminismFlags

    out: dict[str, Any] = DeterminismFlags.capture().to_dict()
    extras: dict[str, Callable[[], Any]] = {
        "mkldnn_enabled": lambda: torch.backends.mkldnn.enabled,
        "mkldnn_deterministic": lambda: torch.backends.mkldnn.deterministic,
        "default_dtype": lambda: str(torch.get_default_dtype()),
        "cuda_matmul_allow_fp16_reduced_precision": (
            lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "cuda_matmul_allow_bf16_reduced_precision": (
            lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
        "sdp_flash": torch.backends.cuda.flash_sdp_enabled,
        "sdp_mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
        "sdp_math": torch.backends.cuda.math_sdp_enabled,
        "sdp_cudnn": lambda: torch.backends.cuda.cudnn_sdp_enabled(),  # type: ignore[no-untyped-call]
        "opt_einsum_enabled": lambda: torch.backends.opt_einsum.enabled,
        "opt_einsum_strategy": lambda: torch.backends.opt_einsum.strategy,
    }
    for key, read in extras.items():
        out.setdefault(key, _safe(read))
    return out


def _env_vars() -> dict[str, str | None]:
    out: dict[str, str | None] = {name: os.environ.get(name) for name in _ENV_VARS}
    for name in sorted(os.environ):
        if name.startswith(_ENV_PREFIXES) and not _SECRET.search(name):
            out[name] = os.environ[name]
    return out


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _packages() -> dict[str, str] | None:
    try:
        dists = list(importlib.metadata.distributions())
    except Exception:
        return None
    wanted = _COMPUTE_PACKAGES | TOOLING_PACKAGES
    out: dict[str, str] = {}
    for dist in dists:
        try:
            # The name the metadata directory carries (Python 3.10+) rules most distributions out
            # without parsing their METADATA file (20+ ms for a full environment, at every start).
            hint = getattr(dist, "_normalized_name", None)
            if isinstance(hint, str) and hint:
                hinted = _normalize(hint)
                if hinted not in wanted and not hinted.startswith("nvidia-"):
                    continue
            name = _normalize(dist.metadata["Name"] or "")
        except Exception:
            continue
        if name in wanted or name.startswith("nvidia-"):
            out.setdefault(name, dist.version)
    return dict(sorted(out.items()))


def _file_sha256(path: Path | None) -> str | None:
    if path is None or not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _git(directory: Path) -> tuple[str | None, str | None, bool | None, dict[str, str | None] | None]:
    """(root, commit, dirty, {changed tracked file: sha256 of its working copy, None if deleted})."""
    out = _run(["git", "-C", str(directory), "rev-parse", "--show-toplevel", "HEAD"])
    if out is None:
        return None, None, None, None
    lines = out.split("\n")
    if len(lines) < 2 or not lines[0]:
        return None, None, None, None
    root, commit = lines[0].strip(), lines[1].strip() or None
    status = _run(["git", "-C", root, "status", "--porcelain=v1", "-z", "--untracked-files=no"])
    if status is None:
        return root, commit, None, None
    paths: list[str] = []
    entries = status.split("\0")
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        code, path = entry[:2], entry[3:]
        if "R" in code or "C" in code:
            i += 1  # the rename's source path follows
        paths.append(path)
    changes: dict[str, str | None] = {}
    for path in sorted(paths)[:_MAX_GIT_CHANGES]:
        changes[path] = _safe(lambda p=path: _file_sha256(Path(root) / p))  # type: ignore[misc]
    if len(paths) > _MAX_GIT_CHANGES:
        changes["..."] = f"{len(paths) - _MAX_GIT_CHANGES} more changed files not listed"
    return root, commit, bool(paths), changes
