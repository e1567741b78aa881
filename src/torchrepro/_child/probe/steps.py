"""Training steps: optimizer steps, and the session's backward steps (training no optimizer sees).

Invariants:
- ``StepWatcher`` registers an optimizer step post-hook (it changes nothing the step computes)
  and is told of each backward step by the session (``after_backward``). After each step it
  tells the shared-memory watcher which parameters the step updated, then writes the probe's
  record: an audit stopped after ``steps`` steps still leaves what it saw.
- Backward steps are counted by the session's ``BackwardSteps`` (``backward``), as the session
  counts them; a fork counts from the number begun when it was made.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from torchrepro._child.probe.shared import SharedMemoryWatcher

__all__ = ["StepWatcher"]


class StepWatcher:
    """Counts training steps (``optimizer_steps``, ``backward_steps``); ``write`` writes the
    probe's record after each."""

    def __init__(self, shared: SharedMemoryWatcher, write: Callable[[], None]) -> None:
        self.shared = shared
        self._write = write
        self.optimizer_steps = 0
        self.backward: Any = None  # the session's BackwardSteps (``steps``: backward steps begun)
        self._backward_base = 0

    def install(self) -> None:
        import torch.optim.optimizer as optim_mod

        watcher = self

        def after_step(opt: Any, *_: Any) -> None:
            watcher.optimizer_steps += 1
            with contextlib.suppress(Exception):
                params = [p for group in opt.param_groups for p in group["params"]]
                watcher.shared.note_update(params, "optimizer", sys._getframe(1))
            watcher._write()

        optim_mod.register_optimizer_step_post_hook(after_step)

    def after_backward(self, frame: FrameType | None) -> None:
        """A ``backward()`` step ended, called from ``frame``: note it and write."""
        with contextlib.suppress(Exception):
            trained = [t for _, t in getattr(self.backward, "_last", ())]
            self.shared.note_update(trained, "backward", frame)
        self._write()

    def after_fork(self) -> None:
        self.optimizer_steps = 0
        self._backward_base = getattr(self.backward, "steps", 0)

    def collect(self) -> dict[str, Any]:
        return {
            "optimizer_steps": self.optimizer_steps,
            "backward_steps": max(0, getattr(self.backward, "steps", 0) - self._backward_base),
        }
