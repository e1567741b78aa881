"""The script's ``torch.compile`` calls and inductor's deterministic switch.

Invariants:
- ``CompileWatcher`` wraps ``torch.compile``: each call is noted (the user's line, the backend
  by name, the mode) before the original runs with the same arguments.
- ``inductor_deterministic`` is read when collected, and only when inductor's config is already
  loaded (collecting never imports it).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from torchrepro._child.probe.watcher import user_location

__all__ = ["CompileWatcher"]


class CompileWatcher:
    """Records ``torch.compile`` calls (``compile_calls``, ``inductor_deterministic``)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def install(self) -> None:
        watcher = self
        original_compile = torch.compile

        @functools.wraps(original_compile)
        def compile_(*a: Any, **kw: Any) -> Any:
            backend = kw.get("backend", "inductor")
            watcher.calls.append(
                {
                    "location": user_location(),
                    "backend": backend
                    if isinstance(backend, str)
                    else getattr(backend, "__name__", "custom"),
                    "mode": kw.get("mode"),
                }
            )
            return original_compile(*a, **kw)

        torch.compile = compile_

    def after_fork(self) -> None:
        self.calls = []

    def collect(self) -> dict[str, Any]:
        inductor = sys.modules.get("torch._inductor.config")
        return {
            "inductor_deterministic": getattr(inductor, "deterministic", None) if inductor else None,
            "compile_calls": tuple(self.calls),
        }
