"""Sharded state (FSDP2 modules and their optimizers) through torch.distributed.checkpoint (DCP).

Invariants:
- A module with DTensor parameters (``fully_shard``) and an optimizer over such parameters are
  saved through DCP, the existing engine: ``get_model_state_dict``/``get_optimizer_state_dict``
  (each rank its shards, keys by parameter name), ``dcp.save`` into ``<path>.dcp``, and loaded by
  ``dcp.load`` into the state dicts of the objects as they are sharded now, then
  ``set_model_state_dict``/``set_optimizer_state_dict``: any world size reshards.
- The directory appears complete or not at all: DCP writes ``<path>.dcp.tmp``; rank 0 renames it
  once every rank has written (an older directory at the path is replaced only then).
- Loading is safe: DCP's metadata file is unpickled by an unpickler that admits only DCP's own
  metadata classes, torch sizes and dtypes and plain containers, and non-tensor entries load with
  ``weights_only=True`` (DCP's defaults are a plain ``pickle.load`` and ``weights_only=False``).
- Verified independently of sharding: the rank-0 checkpoint file records a CRC32 of every row
  (dim-0 slice) of every tensor of the saved state, gathered from the ranks' shards (FSDP2 never
  splits a row); after a load each rank checks its own rows, at their global offset, and a
  mismatch is a ``CheckpointError`` naming the object and entry.
- Gradients of a sharded module are not saved: resume it at a global batch boundary (after
  ``optimizer.step()``), as ``InvariantDataParallel`` requires anyway.
"""

from __future__ import annotations

import io
import pickle
import shutil
import sys
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchrepro.errors import CheckpointError

SUFFIX = ".dcp"


def is_sharded(obj: Any) -> bool:
    """Whether ``obj`` is a module with DTensor parameters or an optimizer over one."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # loaded wherever a DTensor exists
    if dtensor is None:
        return False
    DTensor = dtensor.DTensor

    if isinstance(obj, torch.nn.Module):
        return any(isinstance(p, DTensor) for p in obj.parameters())
    if isinstance(obj, torch.optim.Optimizer):
        return any(isinstance(p, DTensor) for group in obj.param_groups for p in group["params"])
    return False


def directory_of(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def held(entry: Mapping[str, Any]) -> bool:
    """Whether a checkpoint file's entry keeps its state in the DCP directory beside the file."""
    return entry.get("sharded") is True and isinstance(entry.get("state"), Mapping)


def missing_directory(file: Path, state: Mapping[str, Any]) -> Path | None:
    """The DCP directory ``state`` (a ``held`` entry's, saved with ``file``) names, when it is
    missing or incomplete (no ``.metadata``, which DCP writes last); else None."""
    directory = file.with_name(str(state.get("dcp")))
    return None if (directory / ".metadata").is_file() else directory


def _pairs(objects: Mapping[str, Any]) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]:
    """Each sharded object's (module, optimizer or None); an optimizer goes with the module that
    holds all of its parameters (DCP names optimizer state by the module's parameter names)."""
    modules = {n: o for n, o in objects.items() if isinstance(o, torch.nn.Module)}
    out: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]] = {
        n: (m, None) for n, m in modules.items()
    }
    for name, opt in objects.items():
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        held = {id(p) for group in opt.param_groups for p in group["params"]}
        owner = next((m for m in modules.values() if held <= {id(p) for p in m.parameters()}), None)
        if owner is None:
            raise CheckpointError(
                f"Cannot checkpoint the sharded optimizer {name!r} alone: DCP names its state by the "
                "parameter names of its module; pass the FSDP2 module too (model=..., optimizer=...)."
            )
        out[name] = (owner, opt)
    return out


def _state(pairs: Mapping[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        name: get_model_state_dict(module) if opt is None else get_optimizer_state_dict(module, opt)
        for name, (module, opt) in pairs.items()
    }


def save(path: Path, objects: Mapping[str, Any], rank: int) -> dict[str, dict[str, Any]]:
    """Write ``objects``' state into ``<path>.dcp`` (collective: every rank calls it); return each
    object's stored entry state for the rank-0 file: the directory's name and the row checksums."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    pairs = _pairs(objects)
    state = _state(pairs)
    final = directory_of(path)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    dcp_save(state, storage_writer=FileSystemWriter(str(tmp)))
    mine = {name: _rows(value) for name, value in state.items()}
    gathered: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank == 0:
        old = final.with_name(final.name + ".old")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return {name: {"dcp": final.name, "rows": _assemble([g[name] for g in gathered])} for name in state}


def load(
    path: Path, objects: Mapping[str, Any], stored: Mapping[str, Mapping[str, Any]], *, verify: bool
) -> None:
    """Load ``objects`` (sharded as they are now) from the directory their entries name."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    names = {stored[n]["dcp"] for n in objects}
    if len(names) != 1:
        raise CheckpointError(f"Checkpoint {path} names several sharded directories: {sorted(names)}.")
    directory = path.with_name(names.pop())
    if missing_directory(path, stored[next(iter(objects))]) is not None:
        raise CheckpointError(
            f"Checkpoint {path} keeps its sharded state in {directory}, which is missing or incomplete "
            "(no .metadata): copy the directory along with the file, or resume from another checkpoint."
        )
    pairs = _pairs(objects)
    state = _state(pairs)
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _safe_reader(str(directory))
    try:
        dcp_load(state, storage_reader=reader, planner=_safe_planner())
    except (Exception, CheckpointException) as e:  # DCP's wraps every rank's failure (a BaseException)
        cause = reader.refused or f"{type(e).__name__}: {_last_line(e)}"
        raise CheckpointError(
            f"Cannot load the sharded state in {directory} into {sorted(objects)}: {cause}"
        ) from None
    if verify:
        for name, value in state.items():
            _check_rows(path, name, value, stored[name]["rows"])
    for name, (module, opt) in pairs.items():
        if opt is None:
            set_model_state_dict(module, state[name])
    for name, (module, opt) in pairs.items():
        if opt is not None:
            set_optimizer_state_dict(module, opt, state[name])


# -- row checksums --------------------------------------------------------------------------


def _leaves(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{prefix}/{k}" if prefix else str(k))]
    if isinstance(value, (list, tuple)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{prefix}/{i}")]
    return [(prefix, value)]


def _local(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's rows of ``t`` and the global index of the first (FSDP2: ``Shard(0)`` over one
    mesh dimension, torch.chunk's split; anything else is whole on every rank)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return t, 0
    local = t.to_local()
    if t.device_mesh.ndim == 1 and isinstance(t.placements[0], Shard) and t.placements[0].dim == 0:
        rows, world = t.shape[0], t.device_mesh.size()
        per = -(-rows // world)
        return local, min(t.device_mesh.get_local_rank() * per, rows)
    return t.full_tensor(), 0


def _row_crcs(t: torch.Tensor) -> list[int]:
    flat = t.detach().cpu().contiguous()
    rows = flat.shape[0] if flat.dim() else 1
    width = flat.numel() // rows if rows else 0
    if rows == 0 or width == 0:
        return [0] * rows
    data = flat.reshape(rows, width).view(torch.uint8).numpy()  # the bytes of each row
    return [zlib.crc32(data[i]) for i in range(rows)]


def _rows(value: Any) -> dict[str, tuple[int, list[int]]]:
    out = {}
    for key, leaf in _leaves(value):
        if isinstance(leaf, torch.Tensor):
            local, offset = _local(leaf)
            out[key] = (offset, _row_crcs(local))
    return out


def _assemble(parts: list[dict[str, tuple[int, list[int]]]]) -> dict[str, torch.Tensor]:
    """Every rank's rows of each entry, placed at their offsets (rows held twice must agree)."""
    out = {}
    for key in parts[0]:
        rows: dict[int, int] = {}
        for part in parts:
            offset, crcs = part[key]
            for i, crc in enumerate(crcs):
                if rows.setdefault(offset + i, crc) != crc:
                    raise CheckpointError(f"Ranks hold different values for row {offset + i} of {key!r}.")
        out[key] = torch.tensor([rows[i] for i in range(len(rows))], dtype=torch.int64)
    return out


def _check_rows(path: Path, name: str, value: Any, stored: Mapping[str, torch.Tensor]) -> None:
    mine = _rows(value)
    if set(mine) != set(stored):
        raise CheckpointError(
            f"Restoring {name!r} from {path}: the state holds entries {sorted(set(mine) ^ set(stored))[:5]} "
            "that the checkpoint's checksums do not (or the other way round); restore into an object "
            "built like the one that was saved."
        )
    for key, (offset, crcs) in mine.items():
        expected = stored[key][offset : offset + len(crcs)].tolist()
        if crcs != expected:
            raise CheckpointError(
                f"Checkpoint {path} is corrupt: the sharded state of {name!r} ({key}) does not match its "
                "checksums after loading. Nothing was restored into it; resume from an earlier checkpoint."
            )


def _last_line(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


# -- safe reading -----------------------------------------------------------------------------

_SAFE_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._extension",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.storage",
)
_SAFE_NAMES = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
    ("pathlib", "PosixPath"),  # the checkpoint id DCP notes
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("enum", "Enum"),
}


class _Unpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch sizes and dtypes, and plain containers only."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _SAFE_MODULES or (module, name) in _SAFE_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"its metadata refers to {module}.{name}, which is not part of DCP's metadata: refused "
            "(the file may not come from torch.distributed.checkpoint)"
        )


def _safe_reader(path: str) -> Any:
    """DCP's file reader, its metadata unpickled safely (the class is built on first use: DCP
    imports torch.distributed)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class SafeReader(FileSystemReader):
        refused: str | None = None  # why the metadata was refused (DCP's exception buries it)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

            if kwargs.get("rank") is not None:  # DCP's per-rank metadata: never written here
                raise FileNotFoundError("no per-rank metadata")
            with self.fs.create_stream(self._get_metadata_path(None), "rb") as stream:
                try:
                    metadata = _Unpickler(stream).load()
                except pickle.UnpicklingError as e:
                    self.refused = str(e)
                    raise
            if not isinstance(metadata, Metadata):
                self.refused = f"its metadata is a {type(metadata).__name__}, not DCP's Metadata: refused"
                raise pickle.UnpicklingError(self.refused)
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _safe_planner() -> Any:
    """DCP's default load planner, its non-tensor entries loaded with ``weights_only=True``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafePlanner()
