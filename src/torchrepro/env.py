"""The environment fingerprint: everything outside the script that decides a run's bits.

Invariants:
- ``collect_env`` only reads: it never initialises CUDA (GPUs come from ``torch.cuda`` only when
  CUDA has already started in this process, otherwise from ``nvidia-smi``), never imports the
  packages whose versions it reports (``importlib.metadata``), never takes git's index lock, and
  bounds every subprocess with a short timeout. A value that cannot be collected is ``None``.
- ``Environment.to_dict()`` is plain JSON; ``Environment.from_dict`` accepts what any version
  wrote (missing fields are ``None``, unknown fields are kept in ``extra``) and refuses, with an
  ``EnvFileError``, anything else: a non-object, a known field of the wrong type, values that are
  not strict JSON (NaN, infinities, nesting deeper than ``_jsonread.MAX_JSON_DEPTH``...). So
  ``load_env`` raises nothing but ``EnvFileError`` (naming the file), and ``diff_env`` of two
  loaded environments never fails, whatever the fields nested inside them hold.
- ``diff_env`` reports every difference, each classified once, by the table ``_RULES`` below, as
  breaking bitwise reproducibility or harmless, with the one-line reason of its class. When in
  doubt a difference is classed as breaking: a false alarm costs a look, a missed cause costs days.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib
import importlib.metadata
import os
import platform
import re
import reprlib
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchrepro._child.spec import ENV_PREFIX, LOCATION_VARIABLES
from torchrepro._version import __version__
from torchrepro.errors import EnvFileError
from torchrepro._jsonread import json_problem, parse_json
from torchrepro.runrecord import ENV_FILE

__all__ = ["EnvDifference", "Environment", "collect_env", "diff_env", "load_env"]

SCHEMA_VERSION = 1
_SUBPROCESS_TIMEOUT_S = 2.0
_MAX_GIT_CHANGES = 200

# --- what is collected ------------------------------------------------------------------------

#: Environment variables always listed (``None`` when unset), then every variable with a prefix.
_ENV_VARS = (
    "PYTHONHASHSEED",
    "CUBLAS_WORKSPACE_CONFIG",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
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
_TOOLING_PACKAGES = frozenset(["tensorboard", "wandb", "mlflow", "tqdm", "hydra-core", "omegaconf", "rich"])

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


def _json_value(v: Any) -> Any:
    """A deep JSON-able copy (dicts with string keys, lists, str/int/float/bool/None)."""
    if isinstance(v, Mapping):
        return {str(k): _json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


@dataclass(frozen=True)
class Environment:
    """What a run's bits depend on besides the script and its seed (see ``collect_env``).

    Every field is plain JSON; ``None`` means "could not be collected". ``to_dict``/``from_dict``
    round-trip; ``diff_env`` explains the differences between two.
    """

    collected_at: str | None = None
    hostname: str | None = None
    python_version: str | None = None
    python_implementation: str | None = None
    python_executable: str | None = None
    hash_randomization: bool | None = None
    platform: str | None = None
    machine: str | None = None
    libc: str | None = None
    torchrepro_version: str | None = None
    torch_version: str | None = None
    torch_git_version: str | None = None
    torch_debug: bool | None = None
    torch_build: dict[str, Any] | None = None
    cuda_version: str | None = None
    hip_version: str | None = None
    cudnn_version: str | None = None
    nccl_version: str | None = None
    cuda_initialized: bool | None = None
    gpu_driver: str | None = None
    gpus: list[dict[str, Any]] | None = None
    cpu_model: str | None = None
    cpu_count: int | None = None
    cpu_capability: str | None = None
    cpu_flags: list[str] | None = None
    num_threads: int | None = None
    num_interop_threads: int | None = None
    omp_max_threads: int | None = None
    mkl_max_threads: int | None = None
    determinism: dict[str, Any] | None = None
    env_vars: dict[str, str | None] | None = None
    packages: dict[str, str] | None = None
    script: str | None = None
    script_sha256: str | None = None
    git_root: str | None = None
    git_commit: str | None = None
    git_dirty: bool | None = None
    git_changes: dict[str, str | None] | None = None
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (what ``env --json`` prints and run records store)."""
        out = {
            f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"
        }
        out.update(_json_value(self.extra))
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Environment:
        """Rebuild from ``to_dict()`` output; raises ``EnvFileError`` if it is not one."""
        if not isinstance(d, Mapping):
            raise EnvFileError(f"An environment must be a JSON object, got {type(d).__name__}.")
        problem = json_problem(dict(d))
        if problem is not None:
            raise EnvFileError(f"An environment must be strict JSON: {problem}.")
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        if not any(k in d for k in ("torch_version", "python_version", "collected_at")):
            raise EnvFileError(
                "This JSON object is not a torchrepro environment: it has none of the keys "
                "torch_version, python_version, collected_at (write one with `torchrepro env --json`)."
            )
        values: dict[str, Any] = {}
        for name, value in d.items():
            if name in known:
                _check_field(name, value)
                values[name] = _json_value(value)
        extra = {k: _json_value(v) for k, v in d.items() if k not in known}
        return cls(**values, extra=extra)


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "hash_randomization": (bool,),
    "torch_debug": (bool,),
    "cuda_initialized": (bool,),
    "git_dirty": (bool,),
    "cpu_count": (int,),
    "num_threads": (int,),
    "num_interop_threads": (int,),
    "omp_max_threads": (int,),
    "mkl_max_threads": (int,),
    "schema_version": (int,),
    "torch_build": (dict,),
    "determinism": (dict,),
    "env_vars": (dict,),
    "packages": (dict,),
    "git_changes": (dict,),
    "gpus": (list,),
    "cpu_flags": (list,),
}


def _check_field(name: str, value: Any) -> None:
    if value is None:
        return
    types = _FIELD_TYPES.get(name, (str,))
    if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
        expected = " or ".join(t.__name__ for t in types)
        raise EnvFileError(
            f"Field {name!r} must be {expected} or null, got {type(value).__name__}: {reprlib.repr(value)}."
        )


@dataclass(frozen=True)
class EnvDifference:
    """One differing value between two environments, classified.

    ``key`` is a dotted path (``determinism.cudnn_benchmark``, ``env_vars.OMP_NUM_THREADS``,
    ``packages.numpy``, ``gpus[0].name``); ``a``/``b`` are the values (``None`` = absent or not
    collected); ``breaks`` tells whether such a difference can change a run's bits; ``reason`` is
    the one-line reason of its class.
    """

    key: str
    a: Any
    b: Any
    breaks: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (one element of ``env diff --json``'s ``differences``)."""
        return {"key": self.key, "a": self.a, "b": self.b, "breaks": self.breaks, "reason": self.reason}


# --- collect -------------------------------------------------------------------------------------


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
    initialized = bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
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
    wanted = _COMPUTE_PACKAGES | _TOOLING_PACKAGES
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


# --- load and diff -------------------------------------------------------------------------------


def load_env(path: str | os.PathLike[str]) -> Environment:
    """Load an environment from a JSON file written by ``torchrepro env --json``, a JSON object
    with an ``"env"`` key (a run's metadata), or a run-record directory (its ``env.json``).

    Raises ``EnvFileError`` naming the file when it is missing, unreadable or malformed.
    """
    p = Path(path)
    if p.is_dir():
        p = p / ENV_FILE
    try:
        text = p.read_bytes()
    except FileNotFoundError:
        raise EnvFileError(
            f"Environment file {str(p)!r} does not exist; write one with `torchrepro env --json > FILE`."
        ) from None
    except OSError as exc:
        raise EnvFileError(f"Cannot read environment file {str(p)!r}: {exc}.") from None
    try:
        data = parse_json(text)
    except ValueError as exc:
        raise EnvFileError(f"Environment file {str(p)!r} is {exc}.") from None
    if isinstance(data, dict) and isinstance(data.get("env"), dict):
        data = data["env"]
    try:
        return Environment.from_dict(data)
    except EnvFileError as exc:
        raise EnvFileError(f"Environment file {str(p)!r} is malformed: {exc}") from None


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):  # an empty dict adds no key: "nothing" equals "absent"
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif prefix == "gpus" and isinstance(value, list):
        out[f"{prefix}.count"] = len(value)
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value


# (pattern on the dotted key, breaks, reason). First match wins; the default breaks.
_RULES: tuple[tuple[str, bool, str], ...] = (
    # harmless: identity of the machine, time, paths, tooling
    (r"collected_at$", False, "when the environment was collected"),
    (r"hostname$", False, "the machine's name does not enter any computation"),
    (r"python_executable$", False, "where the interpreter lives; its version is compared separately"),
    (r"platform$", False, "the OS kernel string; the C library and CPU are compared separately"),
    (r"(script|git_root)$", False, "a path; the script's content and commit are compared separately"),
    (r"git_dirty$", False, "a summary; the changed files themselves are compared separately"),
    (r"cuda_initialized$", False, "whether CUDA had started when the environment was collected"),
    (r"cpu_count$", False, "the CPUs present; the thread counts actually used are compared separately"),
    (
        r"num_interop_threads$",
        False,
        "inter-op threads run independent ops side by side; each op's result is unchanged",
    ),
    (r"gpus\[\d+\]\.memory_mb$", False, "the memory size of the same GPU model does not change results"),
    (r"schema_version$", False, "the version of this file's format"),
    (
        r"env_vars\.(CUDA_VISIBLE_DEVICES)$",
        False,
        "which physical GPU is used; the GPU model and count are compared separately",
    ),
    (
        r"env_vars\.(CUDA_LAUNCH_BLOCKING|CUDA_MODULE_LOADING|CUDA_CACHE_\w+|CUDA_DEVICE_ORDER)$",
        False,
        "how kernels are launched or loaded, not what they compute",
    ),
    (
        r"env_vars\.(KMP_AFFINITY|KMP_BLOCKTIME|KMP_SETTINGS|KMP_WARNINGS|OMP_PROC_BIND|OMP_PLACES|OMP_DISPLAY_\w+|GOMP_CPU_AFFINITY|OMP_WAIT_POLICY|GOMP_SPINCOUNT)$",
        False,
        "thread placement and waiting, not how work is split",
    ),
    (
        r"env_vars\.NCCL_(DEBUG\w*|SOCKET_IFNAME|ASYNC_ERROR_HANDLING|BLOCKING_WAIT|TIMEOUT\w*|IB_TIMEOUT|DEBUG_FILE)$",
        False,
        "NCCL logging, networking and error handling, not the reduction",
    ),
    (
        r"env_vars\.(TORCH_LOGS|TORCH_SHOW_CPP_STACKTRACES|TORCH_HOME|TORCH_EXTENSIONS_DIR|TORCHINDUCTOR_CACHE_DIR|TORCH_DISTRIBUTED_DEBUG|TORCH_NCCL_\w*(ERROR|WAIT|TIMEOUT|DUMP|TRACE)\w*|PYTORCH_CUDA_ALLOC_CONF|PYTORCH_NVML_BASED_CUDA_CHECK|PYTORCH_NO_CUDA_MEMORY_CACHING|TORCH_CPP_LOG_LEVEL)$",
        False,
        "logging, caches and memory management; kernels and numerics are unchanged",
    ),
    (
        r"env_vars\.(" + "|".join(re.escape(v) for v in LOCATION_VARIABLES) + r")$",
        False,
        "where torchrepro writes its records",
    ),
    (
        r"packages\.(" + "|".join(re.escape(p) for p in sorted(_TOOLING_PACKAGES)) + r")$",
        False,
        "logging, configuration or progress tooling; it does not compute training values",
    ),
    (
        r"git_changes\.(.*\.(md|rst|adoc)|(.*/)?(LICENSE|NOTICE|AUTHORS|CHANGELOG)[^/]*|(.*/)?\.git\w+|docs?/.*)$",
        False,
        "an uncommitted change to documentation, not code or data",
    ),
    (r"extra\.", False, "a field this torchrepro version does not know"),
    # breaks
    (
        r"python_version$",
        True,
        "Python's standard library (random, hashing, sets) may change between minor releases",
    ),
    (r"python_implementation$", True, "another interpreter (CPython, PyPy) may iterate and hash differently"),
    (
        r"hash_randomization$|env_vars\.PYTHONHASHSEED$",
        True,
        "set and dict iteration order over strings depends on the hash seed",
    ),
    (r"machine$", True, "another CPU architecture runs other kernels"),
    (r"libc$", True, "math functions from the C library may round differently"),
    (
        r"torchrepro_version$",
        True,
        "torchrepro derives the seeds; another version may derive them differently",
    ),
    (
        r"torch_(version|git_version|debug)$",
        True,
        "another PyTorch build may use other kernels and algorithms",
    ),
    (
        r"torch_build(\.|$)",
        True,
        "PyTorch's build options and bundled libraries (BLAS, oneDNN, MKL) decide which kernels run",
    ),
    (
        r"(cuda|hip|cudnn|nccl)_version$",
        True,
        "CUDA, cuDNN and NCCL versions choose the GPU kernels and reduction orders",
    ),
    (
        r"gpu_driver$",
        True,
        "the driver JIT-compiles PTX and hosts cuBLAS/cuDNN heuristics; results are not promised equal",
    ),
    (
        r"gpus",
        True,
        "another GPU model, or another number of GPUs, runs other kernels or splits work differently",
    ),
    (
        r"cpu_(model|flags)",
        True,
        "oneDNN and MKL choose kernels and blocking per CPU model and instruction set",
    ),
    (
        r"cpu_capability$|env_vars\.(ATEN_CPU_CAPABILITY|ONEDNN_\w+|DNNL_\w+)$",
        True,
        "selects the SIMD kernels used on the CPU (avx2 vs avx512 change gradients)",
    ),
    (
        r"(num_threads|omp_max_threads|mkl_max_threads)$|env_vars\.\w*NUM_THREADS$",
        True,
        "CPU reductions are split across threads; another split changes float sums",
    ),
    (
        r"determinism(\.|$)",
        True,
        "a determinism or precision switch; it changes which kernels run or how they round",
    ),
    (
        r"env_vars\.(CUBLAS\w*|CUDNN_\w+)$",
        True,
        "cuBLAS/cuDNN settings pick workspaces and algorithms (no fixed workspace: nondeterministic)",
    ),
    (r"env_vars\.NVIDIA_TF32_OVERRIDE$", True, "forces TF32 on or off for every matmul and convolution"),
    (r"env_vars\.NCCL_", True, "NCCL tuning can change the reduction algorithm, protocol and order"),
    (
        r"env_vars\.(MKL_|OMP_|KMP_|GOMP_|OPENBLAS_)",
        True,
        "BLAS and OpenMP settings can change how work is split or which code path runs",
    ),
    (r"env_vars\." + re.escape(ENV_PREFIX), True, "torchrepro's seed and mode decide every RNG and switch"),
    (r"env_vars(\.|$)", True, "a PyTorch or CUDA setting; it may change which kernels run"),
    (
        r"packages(\.|$)",
        True,
        "this package's code computes or transforms training values; another version may differ",
    ),
    (r"script_sha256$", True, "the script itself differs"),
    (r"git_commit$", True, "the code in the script's repository differs"),
    (r"git_changes(\.|$)", True, "an uncommitted change to a tracked source or data file differs"),
)
_COMPILED_RULES = tuple((re.compile(p), breaks, reason) for p, breaks, reason in _RULES)
_DEFAULT_RULE = (True, "not classified; assumed to matter")


def _classify(key: str) -> tuple[bool, str]:
    for pattern, breaks, reason in _COMPILED_RULES:
        if pattern.match(key):
            return breaks, reason
    return _DEFAULT_RULE


def _minor(version: Any) -> str | None:
    parts = version.split(".") if isinstance(version, str) else []
    return ".".join(parts[:2]) if len(parts) >= 2 else None


def diff_env(a: Environment, b: Environment) -> list[EnvDifference]:
    """Every difference between two environments, breaking ones first, each with its class.

    >>> a = Environment(torch_version="2.4.0", hostname="alpha", num_threads=8)
    >>> b = dataclasses.replace(a, hostname="beta", num_threads=4)
    >>> [(d.key, d.breaks) for d in diff_env(a, b)]
    [('num_threads', True), ('hostname', False)]
    """
    flat_a: dict[str, Any] = {}
    flat_b: dict[str, Any] = {}
    _flatten(a.to_dict(), "", flat_a)
    _flatten(b.to_dict(), "", flat_b)
    known = {f.name for f in dataclasses.fields(Environment)}
    order = list(flat_a) + [k for k in flat_b if k not in flat_a]
    out: list[EnvDifference] = []
    for key in order:
        va, vb = flat_a.get(key), flat_b.get(key)
        if va == vb and isinstance(va, bool) == isinstance(vb, bool):
            continue
        top = re.split(r"[.\[]", key, maxsplit=1)[0]
        breaks, reason = _classify(key if top in known else f"extra.{key}")
        if key == "python_version" and _minor(va) is not None and _minor(va) == _minor(vb):
            breaks, reason = False, "a patch release of the same Python; random and hashing are unchanged"
        out.append(EnvDifference(key=key, a=va, b=vb, breaks=breaks, reason=reason))
    out.sort(key=lambda d: not d.breaks)
    return out
