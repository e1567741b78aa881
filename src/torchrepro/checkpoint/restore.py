"""Restoring a checkpoint into the caller's objects: every check first, then the copies, the RNG last.

Invariants:
- Objects are restored by kind in one order (modules, optimizers, schedulers, scalers, other
  stateful objects, loaders, generators). The full ``RngState`` is always saved and is restored
  LAST, after every object (loaders included) is set up, so nothing consumes random numbers
  between the restore and training.
- ``load_checkpoint`` checks what it can cheaply before it copies anything into the objects
  passed (names, kinds, a module's keys, shapes and dtypes, an optimizer's parameter groups, the
  RNG state), so a load refused by those checks changes nothing.
- ``load_checkpoint`` checksums the restored state again and raises ``CheckpointError`` naming
  the object when it differs from the saved checksum (corrupt bytes, partial loads, dtype
  narrowing); plain values, loaders and the RNG state are checked as stored, before any copy.
- A module's gradients come back with it (``None`` where none was saved), copied into an existing
  gradient tensor when it fits.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchrepro._runtime import process_group
from torchrepro.checkpoint import dcp
from torchrepro.checkpoint.format import (
    KIND_WORDS,
    _clock,
    _digest,
    _environment,
    _unpack,
    _verify,
    env_differences,
    kind_of,
    rank_path,
)
from torchrepro.checkpoint.reading import MMAP, _read, check_limit
from torchrepro.checkpoint.writing import wait_pending
from torchrepro.errors import CheckpointError, ReproError, ReproWarning, warn_once

if TYPE_CHECKING:
    from torchrepro.rng import RngState

__all__ = ["load_checkpoint"]

# Kinds, in the order load_checkpoint restores them (RNG comes after all of them).
_RESTORE_ORDER = ("module", "optimizer", "scheduler", "grad_scaler", "stateful", "loader", "generator")
# Kinds whose stored state is verified against its checksum instead of the restored one: plain
# values are not restored into anything, and a loader normalises its position on load (a finished
# epoch becomes the start of the next one), so its restored state_dict may differ legitimately.
_VERIFIED_AS_STORED = ("value", "loader")


def _shape_invariant(payload: Mapping[str, Any]) -> bool:
    """Whether the run that saved ``payload`` trained on global batches (a ``SeededLoader`` with
    ``global_batch_size`` was saved): its state is the same on every rank and its position a
    number of global batches, so it resumes on another world size."""
    return any(
        entry.get("kind") == "loader"
        and isinstance(entry.get("state"), Mapping)
        and isinstance(entry["state"].get("global_batch_size"), int)
        for entry in payload["objects"].values()
    )


def load_checkpoint(
    path: str | os.PathLike[str],
    /,
    *,
    map_location: Any = "cpu",
    restore_rng: bool = True,
    verify: bool = True,
    max_expanded_bytes: int | None = None,
    **objects: Any,
) -> dict[str, Any]:
    """Restore the named ``objects`` in place from ``path``, the RNG state last; return plain values.

    Objects are restored in the order modules, optimizers, schedulers, scalers, other stateful
    objects, loaders, generators; then the global RNG state (Python, NumPy, torch CPU, every
    initialised CUDA device) is restored, so the next random draw is the one the saved run made.
    Returns every plain value in the file (e.g. ``{"step": 30}``). With ``verify`` (default)
    each restored object's state is checksummed and compared with the saved checksum
    (loaders, plain values and the RNG state are checked as stored, before anything is restored:
    a loader's position is normalised on load, a finished epoch becoming the next one).
    ``restore_rng=False`` leaves the global RNG as it is (not an exact resume).

    Before anything is copied into the objects, what can be checked cheaply is: names and kinds,
    each module's keys, shapes and (with ``verify``) dtypes, each optimizer's parameter groups,
    the RNG state and generators, the checksums of plain values and loaders. A load refused by
    those checks leaves every object as it was. Found only after the copy: an object's own
    ``load_state_dict`` refusing the state (e.g. a loader built with another batch size), and a
    restored state that does not match its checksum (corrupt tensor bytes, lossy restores); a
    second checksum pass before the copy would slow every load, and ``latest_checkpoint``
    already checks the stored states.

    ``max_expanded_bytes`` caps what reading the file may unpack (the zip members' declared
    sizes, plus copies of non-contiguous tensor views for the checksums); a file declaring more
    is refused before it is unpacked. The default, ``None``, is twice the file's size plus
    64 MiB, which every file ``torch.save`` writes stays within.

    Raises ``CheckpointError`` naming the file and object: unknown names (listing the ones
    present), kind mismatches, corrupt or truncated files, paths that are not readable files,
    restores that do not reproduce the saved state, a different world size (unless the run
    trained on global batches, ``SeededLoader(global_batch_size=...)``: its state is the same on
    every rank, so every rank then restores rank 0's file, RNG streams included, and the loader
    continues after the same number of global batches). Warns
    (``ReproWarning``) when the checkpoint was saved in a different environment (torch version,
    devices, determinism switches, threads).
    """
    from torchrepro.rng import RngState

    check_limit(max_expanded_bytes)
    # A file still being fsynced is complete at its path: reading it needs no wait. A background
    # fsync that already failed is raised here.
    wait_pending(block=False)
    base = Path(path)
    rank, world_size = process_group()
    file = rank_path(base, rank)
    read = functools.partial(
        _read, map_location=map_location, mmap=MMAP, max_expanded_bytes=max_expanded_bytes
    )
    if rank > 0 and not file.exists() and base.exists():
        payload = read(base)  # saved by fewer ranks: an invariant run may resume from rank 0's file
        if payload["meta"]["world_size"] == world_size or not _shape_invariant(payload):
            raise CheckpointError(
                f"Rank {rank} has no checkpoint file {file} beside {base}: every rank must call "
                "save_checkpoint(path, ...) with the same path (each saves its own RNG state)."
            )
        file = base
    else:
        payload = read(file)
    meta, entries = payload["meta"], payload["objects"]
    if meta["world_size"] != world_size:
        if not _shape_invariant(payload):
            raise CheckpointError(
                f"Checkpoint {file} was saved by a run with world size {meta['world_size']}; this run has "
                f"world size {world_size}. Each rank's RNG state is saved per rank, so resume with the same "
                f"number of processes (e.g. torchrun --nproc-per-node {meta['world_size']}), or train with "
                "SeededLoader(global_batch_size=...) and InvariantDataParallel, whose checkpoints resume "
                "on any world size that divides the micro-batch count."
            )
        if file != base:  # every rank of an invariant run holds the same state: rank 0's file serves all
            file = base
            payload = read(file)
            meta, entries = payload["meta"], payload["objects"]

    for name, obj in objects.items():
        if name not in entries:
            held = ", ".join(sorted(entries)) or "nothing"
            raise CheckpointError(f"Checkpoint {file} has no object {name!r}; it holds: {held}.")
        kind, saved_kind = kind_of(name, obj), entries[name]["kind"]
        if kind == "value":
            raise TypeError(
                f"{name!r} is a plain value: load_checkpoint returns plain values "
                f"(result[{name!r}]) instead of restoring them in place; do not pass it."
            )
        if kind != saved_kind:
            raise CheckpointError(
                f"Checkpoint {file} holds {KIND_WORDS[saved_kind]} under {name!r}, but "
                f"{KIND_WORDS[kind]} ({type(obj).__qualname__}) was given to restore into."
            )
    generators = {n: o for n, o in objects.items() if entries[n]["kind"] == "generator"}
    if generators and not restore_rng:
        raise ValueError(
            f"Generators {sorted(generators)} are restored with the RNG state; drop restore_rng=False."
        )

    diffs = env_differences(payload["env"], _environment(rank, world_size))
    if diffs:
        warn_once(
            "checkpoint-env:" + "|".join(diffs),
            f"Checkpoint {file} was saved in a different environment, so the resumed run may not "
            f"match the original bit for bit: {'; '.join(diffs)}.",
            ReproWarning,
            stacklevel=2,
        )

    ordered = sorted(objects, key=lambda n: _RESTORE_ORDER.index(entries[n]["kind"]))
    # What can be checked cheaply is checked before the first object changes.
    if verify:  # checked as stored: plain values, loaders, the RNG state
        _verify(payload, file, [n for n, e in entries.items() if e["kind"] in _VERIFIED_AS_STORED])
    rng_state = None
    if restore_rng:
        try:
            rng_state = RngState.from_dict(_unpack(payload["rng"]["state"]))
            _check_rng_targets(rng_state, generators)
        except ReproError as e:
            raise CheckpointError(f"Cannot restore the RNG state saved in {file}: {e}") from None
    sharded = {n for n in ordered if dcp.held(entries[n])}  # FSDP2 modules and optimizers
    for name in ordered:
        if name in sharded:
            continue
        if entries[name]["kind"] not in _VERIFIED_AS_STORED and entries[name]["kind"] != "generator":
            _check_before_restore(file, name, objects[name], entries[name]["state"], verify=verify)
        grads = entries[name].get("grads")
        if grads is not None:
            if verify and _digest(grads, name) != entries[name]["grads_digest"]:
                raise CheckpointError(
                    f"Checkpoint {file} is corrupt: the stored gradients of {name!r} do not match "
                    "their checksum. Nothing was changed; resume from an earlier checkpoint."
                )
            problems = _grad_mismatches(objects[name], grads)
            if problems:
                raise CheckpointError(
                    f"Cannot restore the gradients of {name!r} from {file}: the checkpoint holds "
                    f"{_some(problems, quote=False)}. Nothing was changed; restore into a module built "
                    "like the one that was saved."
                )
    if sharded:  # resharded onto this run's sharding, verified row by row
        dcp.load(
            file, {n: objects[n] for n in sharded}, {n: entries[n]["state"] for n in sharded}, verify=verify
        )
    for name in ordered:
        if name in sharded:
            continue
        if entries[name]["kind"] != "generator":
            _restore_one(file, name, objects[name], entries[name]["state"])
            if "grads" in entries[name]:
                _restore_gradients(objects[name], entries[name]["grads"])
    if verify:
        for name in ordered:
            entry = entries[name]
            if entry["kind"] in _VERIFIED_AS_STORED or entry["kind"] == "generator" or name in sharded:
                continue
            if _digest(objects[name].state_dict(), name) != entry["digest"]:
                raise CheckpointError(
                    f"Restoring {name!r} from {file} did not reproduce the saved state (its checksum "
                    "differs): the file is corrupt, or the object cannot hold the saved values exactly "
                    "(different dtype, fewer entries, a load_state_dict that drops or converts "
                    "values). Restore into an object built like the one that was saved."
                )
    if rng_state is not None:
        try:
            rng_state.restore(generators=generators)
        except ReproError as e:  # pragma: no cover - its checks ran above, before any restore
            raise CheckpointError(f"Cannot restore the RNG state saved in {file}: {e}") from None
    _clock.observe(meta["saved_at_ns"], meta["sequence"])
    return {n: e["state"] for n, e in entries.items() if e["kind"] == "value"}


def _check_rng_targets(state: RngState, generators: Mapping[str, Any]) -> None:
    """What ``RngState.restore`` checks before it changes anything (each generator's kind and
    device, the CUDA device count), run before the first object is restored."""
    from torchrepro import rng

    for name, gen in generators.items():
        state._check_target(name, gen)
    rng._check_device_count(state.cuda)


def _check_before_restore(file: Path, name: str, obj: Any, state: Any, *, verify: bool) -> None:
    """Refuse, before anything is copied, a restore that cannot reproduce the saved ``state``: what
    a module's or optimizer's ``load_state_dict`` would refuse only after copying part of it, and
    (with ``verify``) a module dtype that the checksum after the copy would refuse."""
    if isinstance(obj, torch.nn.Module):
        problems, dtypes = _module_mismatches(obj, state, dtypes=verify)
    elif isinstance(obj, torch.optim.Optimizer):
        problems, dtypes = _optimizer_mismatches(obj, state), []
    else:
        problems, dtypes = [], []
    if problems:
        raise CheckpointError(
            f"Cannot restore {name!r} ({type(obj).__qualname__}) from {file}: {'; '.join(problems)}. "
            "Nothing was changed; restore into an object built like the one that was saved."
        )
    if dtypes:
        raise CheckpointError(
            f"Restoring {name!r} from {file} did not reproduce the saved state in a check before "
            "copying: the object cannot hold the saved values exactly "
            f"({_some(dtypes, quote=False)}). Nothing was changed; restore into an object built like "
            "the one that was saved (same dtypes)."
        )


def _module_mismatches(module: torch.nn.Module, state: Any, *, dtypes: bool) -> tuple[list[str], list[str]]:
    """What ``module.load_state_dict(state, strict=True)`` would refuse after copying part of it
    (missing and unexpected keys, shapes), and, with ``dtypes``, the dtypes it would convert."""
    if not isinstance(state, Mapping):
        return [], []  # load_state_dict refuses it before copying anything
    current = module.state_dict(keep_vars=True)
    problems, conversions = [], []
    missing = [k for k in current if k not in state]
    unexpected = [k for k in state if k not in current]
    if missing:
        problems.append(f"Missing key(s) in the checkpoint: {_some(missing)}")
    if unexpected:
        problems.append(f"Unexpected key(s) in the checkpoint: {_some(unexpected)}")
    for key, have in current.items():
        saved = state.get(key)
        if not isinstance(have, torch.Tensor) or key not in state or torch.nn.parameter.is_lazy(have):
            continue
        if not isinstance(saved, torch.Tensor):
            problems.append(f"{key} is a {type(saved).__name__} in the checkpoint, a tensor in the module")
        elif saved.shape != have.shape and not (have.dim() == 0 and saved.shape == (1,)):
            problems.append(
                f"size mismatch for {key}: the checkpoint holds shape {tuple(saved.shape)}, the module "
                f"{tuple(have.shape)}"
            )
        elif dtypes and saved.dtype != have.dtype:
            conversions.append(f"{key} is {saved.dtype} in the checkpoint, {have.dtype} in the module")
    return problems, conversions


def _optimizer_mismatches(optimizer: torch.optim.Optimizer, state: Any) -> list[str]:
    """The parameter-group mismatch ``Optimizer.load_state_dict`` would refuse."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        return []  # malformed: load_state_dict refuses it before changing anything
    saved = [len(g["params"]) for g in groups]
    have = [len(g["params"]) for g in optimizer.param_groups]
    if saved == have:
        return []
    return [f"the checkpoint has parameter groups of {saved} parameters, the optimizer {have}"]


def _some(items: list[str], limit: int = 10, *, quote: bool = True) -> str:
    shown = ", ".join(repr(k) if quote else k for k in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _restore_one(file: Path, name: str, obj: Any, state: Any) -> None:
    try:
        if isinstance(obj, torch.nn.Module):
            obj.load_state_dict(state, strict=True)
        else:
            obj.load_state_dict(state)
    except ReproError as e:
        raise CheckpointError(f"Cannot restore {name!r} from {file}: {e}") from None
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        detail = " ".join(str(e).split())[:600]
        raise CheckpointError(
            f"Cannot restore {name!r} ({type(obj).__qualname__}) from {file}: {detail}. Restore into "
            "an object built like the one that was saved."
        ) from None


# --------------------------------------------------------------------------- gradients


def _grad_mismatches(module: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> list[str]:
    params = dict(module.named_parameters())
    problems = [f"a gradient for {k!r}, a parameter the module lacks" for k in grads if k not in params]
    problems += [
        f"the gradient of {k!r} has shape {tuple(g.shape)}, the parameter {tuple(params[k].shape)}"
        for k, g in grads.items()
        if k in params and g.shape != params[k].shape and not torch.nn.parameter.is_lazy(params[k])
    ]
    return problems


def _restore_gradients(module: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Give every parameter its saved ``.grad`` (``None`` when none was saved), copying into an
    existing gradient tensor when it fits (DDP's bucket views stay attached)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            saved = grads.get(name)
            if saved is None:
                p.grad = None
            elif p.grad is not None and p.grad.shape == saved.shape and p.grad.dtype == saved.dtype:
                p.grad.copy_(saved)
            else:
                p.grad = saved.to(device=p.device, dtype=p.dtype, copy=True)
