"""The checkpoint file format: what one file holds, and the checksums that prove it is intact.

Invariants:
- A checkpoint is one ``torch.save`` file: a dict with the marker ``"torchrepro_checkpoint"``
  (its value the format version), ``meta`` (save clock, rank, world size, names), ``env``,
  ``objects`` (per name: its kind, state and checksum, and a module's gradients with theirs) and
  ``rng`` (the full ``RngState``, long int lists packed as int64 tensors, and its checksum).
- A checkpoint loads with ``torch.load(weights_only=True)``: only tensors, numbers, strings and
  containers of them; anything else is refused when SAVING, naming the object and the key.
- Every object's state is saved with a checksum (structure, dtypes, shapes, CRC32 of the tensor
  bytes: memory speed), the same on every device, so a state saved from CPU verifies on CUDA.
- Under ``torch.distributed`` every rank calls ``save_checkpoint`` with the same ``path``;
  rank 0 writes ``path`` and rank ``r > 0`` writes ``path + ".rank<r>"`` (its own objects and
  RNG state). No collective is used, so a rank that does not save cannot hang the others; a
  missing rank file or a different world size is a clear ``CheckpointError`` at load time.
- The save clock is a wall-clock time kept monotonic across saves and resumes (every save and
  load of this process moves it forward). The clock has its own checksum (format version 2), so
  a damaged clock is refused instead of reordering checkpoints.
- The environment stored with a checkpoint (versions, devices, determinism switches, threads,
  ranks) is compared on load, key by key.
"""

from __future__ import annotations

import hashlib
import platform
import re
import sys
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchrepro import hashing
from torchrepro._runtime import cuda_started
from torchrepro.errors import CheckpointError
from torchrepro.flags import DeterminismFlags
from torchrepro.hashing import fingerprint

__all__ = ["FORMAT_VERSION"]

FORMAT_VERSION = 2
"""Version of the checkpoint layout; files with a newer version are refused with a clear error.

Version 2 adds ``meta["clock_digest"]``, the checksum of the save clock; version 1 files (without
it) are still read."""

MARKER = "torchrepro_checkpoint"
RANK_FILE = re.compile(r"\.rank(\d+)$")  # rank r > 0 writes its own file: path + ".rank<r>"


def rank_path(path: Path, rank: int) -> Path:
    return path if rank == 0 else path.with_name(f"{path.name}.rank{rank}")


# --------------------------------------------------------------------------- save clock


@dataclass
class _Clock:
    """Last save clock seen by this process (saved or loaded), so later saves order after it."""

    saved_at_ns: int = 0
    sequence: int = 0

    def tick(self) -> tuple[int, int]:
        saved_at = max(time.time_ns(), self.saved_at_ns + 1)
        return saved_at, self.sequence + 1

    def observe(self, saved_at_ns: int, sequence: int) -> None:
        self.saved_at_ns = max(self.saved_at_ns, saved_at_ns)
        self.sequence = max(self.sequence, sequence)


_clock = _Clock()


def _clock_digest(saved_at_ns: int, sequence: int) -> str:
    """The checksum of a save clock (``meta["clock_digest"]``, format version 2)."""
    text = f"{saved_at_ns},{sequence}".encode()
    return hashlib.blake2b(text, digest_size=16, person=b"trepro-clock-v2").hexdigest()


# --------------------------------------------------------------------------- kinds

# Every kind an entry of ``objects`` may have, as messages name it.
KIND_WORDS = {
    "module": "a module (torch.nn.Module)",
    "optimizer": "an optimizer (torch.optim.Optimizer)",
    "scheduler": "an LR scheduler",
    "grad_scaler": "a GradScaler (torch.amp.GradScaler)",
    "stateful": "an object with state_dict()/load_state_dict()",
    "loader": "a data loader (torchrepro.SeededLoader)",
    "generator": "an RNG generator (torch.Generator, numpy.random.Generator or RandomState)",
    "value": "a plain value",
}


def _is_numpy_generator(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, (np.random.Generator, np.random.RandomState))


def kind_of(name: str, obj: Any) -> str:
    """The kind an object is saved as; ``TypeError`` naming ``name`` for anything unsupported."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (LRScheduler, ReduceLROnPlateau)):
        return "scheduler"
    if isinstance(obj, torch.amp.GradScaler):
        return "grad_scaler"
    if isinstance(obj, torch.Generator) or _is_numpy_generator(obj):
        return "generator"
    stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
    if isinstance(obj, torch.utils.data.DataLoader):
        if stateful:
            return "loader"
        raise TypeError(
            f"Cannot checkpoint {name!r}: a plain torch DataLoader has no resumable position. "
            "Use torchrepro.SeededLoader(dataset, batch_size=..., seed=...) so a resume neither "
            "replays nor skips batches."
        )
    if stateful:
        return "stateful"
    if _is_plain_value(obj):
        return "value"
    raise TypeError(
        f"Cannot checkpoint {name!r} of type {type(obj).__module__}.{type(obj).__qualname__}: pass a "
        "module, optimizer, LR scheduler, GradScaler, SeededLoader, torch/numpy Generator, an object "
        "with state_dict()/load_state_dict(), or a plain value (number, string, bool, None, tensor, "
        "or dicts/lists of those)."
    )


def _is_plain_value(obj: Any) -> bool:
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return True
    if type(obj) in (list, tuple):
        return all(_is_plain_value(v) for v in obj)
    if type(obj) in (dict, OrderedDict):
        return all(isinstance(k, str) and _is_plain_value(v) for k, v in obj.items())
    return False


# --------------------------------------------------------------------------- weights_only check

_SCALARS: tuple[type, ...] = (bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)
_MAPPINGS: tuple[type, ...] = (dict, OrderedDict, Counter)
_SEQUENCES: tuple[type, ...] = (list, tuple, set, torch.Size)
_FLAT: tuple[type, ...] = (bool, int, float, str, type(None))


def check_loadable(obj: Any, name: str, key: str = "") -> None:
    """Raise ``CheckpointError`` if ``torch.load(weights_only=True)`` would refuse ``obj``."""
    if obj is None or type(obj) in _SCALARS:
        return
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            _refuse(obj, name, key, "a tensor subclass")
        return
    if type(obj) in _MAPPINGS:
        for k, v in obj.items():
            check_loadable(k, name, f"{key}[{k!r}] (the key)")
            check_loadable(v, name, f"{key}[{k!r}]")
        return
    if type(obj) in _SEQUENCES:
        if all(type(v) in _FLAT for v in obj):
            return
        for i, v in enumerate(obj):
            check_loadable(v, name, f"{key}[{i}]")
        return
    _refuse(obj, name, key, "an arbitrary Python object")


def _refuse(obj: Any, name: str, key: str, what: str) -> None:
    where = f"at {key}" if key else "itself"
    raise CheckpointError(
        f"Cannot checkpoint {name!r}: its state {where} is {what} of type "
        f"{type(obj).__module__}.{type(obj).__qualname__}, which torch.load(weights_only=True) refuses. "
        "Checkpoints hold only tensors, numbers, strings and containers of them; convert that "
        "entry (e.g. to a tensor, a number or a string) in the object's state_dict()."
    )


# --------------------------------------------------------------------------- environment


def _determinism_switches() -> dict[str, Any]:
    flags = DeterminismFlags.capture()
    return {
        "deterministic_algorithms": flags.deterministic_algorithms,
        "deterministic_warn_only": flags.warn_only,
        "cudnn.deterministic": flags.cudnn_deterministic,
        "cudnn.benchmark": flags.cudnn_benchmark,
        "cudnn.allow_tf32": flags.cudnn_allow_tf32,
        "cuda.matmul.allow_tf32": flags.cuda_matmul_allow_tf32,
        "float32_matmul_precision": flags.float32_matmul_precision,
        "mkldnn.enabled": bool(torch.backends.mkldnn.enabled),
    }


def _environment(rank: int, world_size: int) -> dict[str, Any]:
    """A small record of what decides the bits: versions, devices, switches, threads, ranks."""
    cuda_devices = []
    if cuda_started():
        cuda_devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "torch": str(torch.__version__),  # TorchVersion is a str subclass weights_only refuses
        "python": platform.python_version(),
        "platform": sys.platform,
        "cuda": torch.version.cuda or "",
        "cuda_devices": cuda_devices,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "num_threads": torch.get_num_threads(),
        "determinism": _determinism_switches(),
        "rank": rank,
        "world_size": world_size,
    }


# Keys compared on load; rank/world size are checked separately (a mismatch is an error).
_ENV_COMPARED = ("torch", "python", "cuda", "cuda_devices", "cpu_capability", "num_threads", "determinism")


def env_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    diffs = []
    for key in _ENV_COMPARED:
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [
                f"{key}.{k}: saved {a.get(k)!r}, now {b.get(k)!r}" for k in sorted(a) if a.get(k) != b.get(k)
            ]
        elif a != b:
            diffs.append(f"{key}: saved {a!r}, now {b!r}")
    return diffs


# --------------------------------------------------------------------------- packing


_PACKED = "__torchrepro_int64_list__"
_INT64 = (-(1 << 63), (1 << 63) - 1)


def pack(obj: Any) -> Any:
    """Long lists of ints (Python's and NumPy's RNG state words) as one int64 tensor each:
    ``torch.load(weights_only=True)`` unpickles a tensor much faster than 625 separate ints."""
    if type(obj) is dict:
        return {k: pack(v) for k, v in obj.items()}
    if (
        type(obj) is list
        and len(obj) >= 64
        and all(type(v) is int and _INT64[0] <= v <= _INT64[1] for v in obj)
    ):
        return {_PACKED: torch.tensor(obj, dtype=torch.int64)}
    if type(obj) is list:
        return [pack(v) for v in obj]
    return obj


def _unpack(obj: Any) -> Any:
    if type(obj) is dict:
        packed = obj.get(_PACKED)
        if len(obj) == 1 and isinstance(packed, torch.Tensor):
            return packed.tolist()
        return {k: _unpack(v) for k, v in obj.items()}
    if type(obj) is list:
        return [_unpack(v) for v in obj]
    return obj


# --------------------------------------------------------------------------- checksums


_PIECE_BYTES = 1 << 22  # tensors are checksummed in 4 MiB pieces, in parallel threads
_PARALLEL_BYTES = 1 << 24  # below this much tensor data, one thread is quicker


def _digest(state: Any, name: str) -> str:
    """A checksum of ``state``'s value: BLAKE2b over its structure, plain values, tensor dtypes
    and shapes, and the CRC32 of every 4 MiB piece of each dense tensor's bytes (the same on
    every device; sparse and quantized tensors contribute their ``fingerprint``).

    CRC32 runs at memory speed (~10x ``fingerprint`` on CPU) and releases the GIL, so pieces
    are checksummed in parallel threads; this keeps saving and verifying close to plain
    ``torch.save``/``torch.load``. It detects every burst error up to 32 bits and any other
    corruption with probability 1 - 2**-32 per piece; the dtype/shape header catches narrowing.
    Dict entries are taken in sorted key order.
    """
    parts: list[bytes | memoryview] = []
    keep: list[torch.Tensor] = []  # contiguous host copies the memoryviews point into
    try:
        _feed(parts, keep, state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"Cannot checksum the state of {name!r} for verification: {e}") from None
    pieces = [p for p in parts if isinstance(p, memoryview)]
    if sum(p.nbytes for p in pieces) >= _PARALLEL_BYTES:
        crcs = iter(hashing.parallel_map(zlib.crc32, pieces))
    else:
        crcs = iter([zlib.crc32(p) for p in pieces])
    h = hashlib.blake2b(digest_size=16, person=b"trepro-ckpt-v1")
    for part in parts:
        h.update(next(crcs).to_bytes(4, "little") if isinstance(part, memoryview) else part)
    return h.hexdigest()


def _feed(parts: list[bytes | memoryview], keep: list[torch.Tensor], obj: Any) -> None:
    kind = type(obj)
    if isinstance(obj, torch.Tensor):
        _feed_tensor(parts, keep, obj)
    elif kind in _MAPPINGS:
        items = sorted(obj.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        parts.append(b"{%d:" % len(items))
        for key, value in items:
            _feed(parts, keep, key)
            _feed(parts, keep, value)
    elif kind in _SEQUENCES and kind is not set:
        if all(type(v) in _FLAT for v in obj):  # repr tells 1, 1.0, True and '1' apart
            parts.append(f"{kind.__name__}{list(obj)!r}".encode())
            return
        parts.append(f"[{kind.__name__}{len(obj)}:".encode())
        for value in obj:
            _feed(parts, keep, value)
    elif kind is set:
        parts.append(f"set{sorted(repr(v) for v in obj)}".encode())
    else:
        parts.append(f"({kind.__name__}){obj!r};".encode())


def _feed_tensor(parts: list[bytes | memoryview], keep: list[torch.Tensor], t: torch.Tensor) -> None:
    parts.append(f"<tensor {t.dtype} {tuple(t.shape)}>".encode())
    if t.layout != torch.strided or t.is_quantized:  # rare in checkpoints: the full fingerprint
        parts.append(fingerprint(t).encode())
        return
    if t.device.type == "meta":
        return
    # Same checksum on every device, so a state saved from CPU verifies when restored to CUDA.
    c = t.detach()
    if c.device.type != "cpu":
        c = c.cpu()
    c = c.resolve_conj().resolve_neg().contiguous()
    if c.numel():
        keep.append(c)
        parts.extend(hashing.chunks(hashing.byte_view(c), _PIECE_BYTES))


def _verify(payload: Mapping[str, Any], path: Path, names: Iterable[str] | None = None) -> None:
    """Check the stored states against their stored checksums (detects corrupt bytes)."""
    objects = payload["objects"]
    for name in objects if names is None else names:
        entry = objects[name]
        if entry["kind"] != "generator" and _digest(entry["state"], name) != entry["digest"]:
            raise CheckpointError(
                f"Checkpoint {path} is corrupt: the stored state of {name!r} does not match its "
                "checksum. Resume from an earlier checkpoint."
            )
        if "grads" in entry and _digest(entry["grads"], name) != entry["grads_digest"]:
            raise CheckpointError(
                f"Checkpoint {path} is corrupt: the stored gradients of {name!r} do not match their "
                "checksum. Resume from an earlier checkpoint."
            )
    if _digest(payload["rng"]["state"], "RNG state") != payload["rng"]["digest"]:
        raise CheckpointError(
            f"Checkpoint {path} is corrupt: the stored RNG state does not match its checksum. "
            "Resume from an earlier checkpoint."
        )
