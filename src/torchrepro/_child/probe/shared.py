"""Shared memory: the script's ``share_memory()`` calls and the steps made on shared parameters.

Invariants:
- ``SharedMemoryWatcher`` wraps ``nn.Module.share_memory`` and ``Tensor.share_memory_``: a call
  from the script's own line (not a library's) is noted once per object and line, at most 100.
- ``note_update`` is told of each training step (``steps``) with the tensors it updated; only
  CPU tensors in shared memory count (a CUDA tensor always says it is shared), at most
  ``_SHARED_CHECKED`` per step. Updates are grouped by the module holding them (found by
  identity in the user's frames, then ``__main__``) and by how they were made, at most 20 groups,
  each with its first and last tick on the process clock (``watcher.Clock``) that starts and
  joins share: so the audit tells concurrent updaters from sequential ones.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import re
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from torchrepro._child.probe.watcher import Clock, user_location
from torchrepro._frames import is_user, user_frame

__all__ = ["SharedMemoryWatcher", "shared_args"]

_SHARED_CHECKED = 256
"""Parameters of a step checked for shared memory (hogwild shares the whole model)."""


def _shared_cpu(tensors: Iterable[Any]) -> list[torch.Tensor]:
    """The CPU tensors among ``tensors`` whose storage is in shared memory (a CUDA tensor always
    says it is shared: it is not counted)."""
    out = []
    for i, t in enumerate(tensors):
        if i >= _SHARED_CHECKED:
            break
        with contextlib.suppress(Exception):
            tensor: Any = t
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and tensor.is_shared():
                out.append(t)
    return out


def _receiver(frame: types.FrameType, method: str) -> str | None:
    """The expression a method was called on at the frame's line (``model`` in ``model.share_memory()``)."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    m = re.search(r"([A-Za-z_][\w.]*)\s*\.\s*" + re.escape(method) + r"\s*\(", line)
    return m.group(1) if m else None


def _holder(tensors: Sequence[torch.Tensor], frame: types.FrameType | None) -> tuple[str | None, str | None]:
    """``(class, variable)`` of the module holding ``tensors`` (or of the tensor itself) that the
    frames from ``frame`` outward, then ``__main__``, refer to; ``(None, None)`` when none does."""
    ids = {id(t) for t in tensors}
    namespaces: list[Mapping[str, Any]] = []
    depth = 0
    while frame is not None and depth < 40:
        namespaces.append(frame.f_locals)
        frame = frame.f_back
        depth += 1
    for name in ("__main__", "__mp_main__"):
        module = sys.modules.get(name)
        if module is not None:
            namespaces.append(vars(module))
    tensor_name: str | None = None
    for namespace in namespaces:
        for var, value in list(namespace.items()):
            if isinstance(value, torch.nn.Module):
                with contextlib.suppress(Exception):
                    if any(id(p) in ids for p in value.parameters()):
                        return type(value).__name__, var
            elif tensor_name is None and isinstance(value, torch.Tensor) and id(value) in ids:
                tensor_name = var
    return ("Tensor", tensor_name) if tensor_name else (None, None)


def shared_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str]:
    """The modules and tensors in shared memory among a process's arguments (by class)."""
    out = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.nn.Module) and _shared_cpu(value.parameters()):
            out.append(type(value).__name__)
        elif isinstance(value, torch.Tensor) and _shared_cpu([value]):
            out.append("Tensor")
    return out


class SharedMemoryWatcher:
    """Records ``share_memory()`` calls (``shared_modules``) and steps on shared parameters
    (``shared_updates``)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.shared_modules: list[dict[str, Any]] = []
        self._shared_updates: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._holders: dict[tuple[int, ...], tuple[str | None, str | None]] = {}

    def install(self) -> None:
        """Note the script's ``share_memory()`` calls (on a module, or ``share_memory_()`` on a tensor)."""
        watcher = self
        module_share = torch.nn.Module.share_memory
        tensor_share: Any = torch.Tensor.share_memory_

        def note(obj: Any, method: str, tensors: list[torch.Tensor]) -> None:
            frame = sys._getframe(2)
            if not is_user(frame) or len(watcher.shared_modules) >= 100:
                return  # called by a library (a module sharing its tensors), not by the script
            location = user_location()
            if any(m["location"] == location and m["_id"] == id(obj) for m in watcher.shared_modules):
                return
            watcher.shared_modules.append(
                {
                    "location": location,
                    "class": type(obj).__name__,
                    "variable": _receiver(frame, method),
                    "params": len(tensors),
                    "_id": id(obj),
                }
            )

        @functools.wraps(module_share)
        def share_memory(module: Any) -> Any:
            result = module_share(module)
            with contextlib.suppress(Exception):
                note(module, "share_memory", list(module.parameters()))
            return result

        @functools.wraps(tensor_share)
        def share_memory_(tensor: Any) -> Any:
            result = tensor_share(tensor)
            with contextlib.suppress(Exception):
                note(tensor, "share_memory_", [tensor])
            return result

        torch.nn.Module.share_memory = share_memory  # type: ignore[method-assign,assignment]
        torch.Tensor.share_memory_ = share_memory_  # type: ignore[method-assign]

    def after_fork(self) -> None:
        self.shared_modules = []
        self._shared_updates = {}

    def collect(self) -> dict[str, Any]:
        return {
            "shared_modules": tuple(
                {k: v for k, v in m.items() if not k.startswith("_")} for m in self.shared_modules
            ),
            "shared_updates": tuple(dict(u) for u in self._shared_updates.values()),
        }

    def note_update(self, tensors: Sequence[torch.Tensor], via: str, frame: Any) -> None:
        """A step updated ``tensors``: note the ones in shared memory, by the module holding them."""
        shared = _shared_cpu(tensors)
        if not shared:
            return
        key_ids = tuple(id(t) for t in shared[:8])
        holder = self._holders.get(key_ids)
        if holder is None:
            holder = self._holders[key_ids] = _holder(shared, user_frame(frame))
        key = (*holder, via)
        seq = self.clock.tick()
        record = self._shared_updates.get(key)
        if record is None:
            if len(self._shared_updates) >= 20:
                return
            record = self._shared_updates[key] = {
                "module": holder[0],
                "variable": holder[1],
                "params": len(shared),
                "via": via,
                "steps": 0,
                "first": seq,
            }
        record["steps"] += 1
        record["last"] = seq
