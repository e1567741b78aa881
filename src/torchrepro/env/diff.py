"""Loading environments (``load_env``) and explaining how two differ (``diff_env``).

Invariants:
- ``load_env`` raises nothing but ``EnvFileError`` (naming the file); since ``Environment.from_dict``
  validated what it read, ``diff_env`` of two loaded environments never fails, whatever the fields
  nested inside them hold.
- ``diff_env`` reports every difference, each classified once, by the table ``_RULES`` below, as
  breaking bitwise reproducibility or harmless, with the one-line reason of its class. When in
  doubt a difference is classed as breaking: a false alarm costs a look, a missed cause costs days.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from torchrepro._jsonread import parse_json
from torchrepro.env.collect import TOOLING_PACKAGES
from torchrepro.env.model import EnvDifference, Environment
from torchrepro.errors import EnvFileError
from torchrepro.protocol import ENV_PREFIX, LOCATION_VARIABLES
from torchrepro.runrecord import ENV_FILE

__all__ = ["diff_env", "load_env"]

# --- load ----------------------------------------------------------------------------------------


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


# --- diff ----------------------------------------------------------------------------------------


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
        r"packages\.(" + "|".join(re.escape(p) for p in sorted(TOOLING_PACKAGES)) + r")$",
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
        r"determinism\.mkldnn_enabled$",
        True,
        "oneDNN on or off: its convolution backward splits reductions by thread (--portable turns it off)",
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
        r"env_vars\.MKL_CBWR$",
        True,
        "oneMKL's conditional numerical reproducibility: the branch picks its code path, and STRICT "
        "makes its GEMMs the same for any thread count (--portable turns strict mode on)",
    ),
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
