"""The determinism switches and process-start settings, and the user's lines that set each switch.

Invariants:
- ``SwitchWatcher`` wraps ``torch.use_deterministic_algorithms``, ``torch.set_num_threads``,
  ``torch.set_float32_matmul_precision``, the setters of cuDNN's ``benchmark``/``allow_tf32``/
  ``deterministic`` and cuBLAS's ``allow_tf32``: each notes the user's line, then sets the value.
  One exception, asked for: ``use_deterministic_algorithms`` is applied with ``warn_only=True``
  (the request is recorded and reported as made), so the audit sees every op.
- The values are read when collected (``DeterminismFlags.capture``); the start environment
  (``PYTHONHASHSEED``, the thread variables) and hash randomization when the watcher is made.
- The switch statements of the user's files (``_child.sources``) are reported with whether any
  of their lines set a switch in this process: one that did not ran on a branch not taken.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any

import torch

from torchrepro._child.sources import accumulation_statements, switch_statements
from torchrepro._frames import shown, user_frame
from torchrepro._runtime import cuda_started
from torchrepro.flags import DeterminismFlags
from torchrepro.protocol import HASH_SEED_VAR, MKL_THREADS_VAR, OMP_THREADS_VAR

__all__ = ["SwitchWatcher"]

_TORCHREPRO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
"""torchrepro's own files: never the user's."""


class SwitchWatcher:
    """Records the settings and the lines that set a switch (the switch fields of ``ProbeSettings``,
    ``num_threads``, ``thread_env``, ``switch_statements``, ``cuda_initialized``)."""

    def __init__(self) -> None:
        self.start_env = {k: os.environ.get(k) for k in (HASH_SEED_VAR, OMP_THREADS_VAR, MKL_THREADS_VAR)}
        self.hash_randomization = bool(sys.flags.hash_randomization)
        self.set_num_threads_called = False
        self.requested_deterministic: tuple[bool, bool] | None = None
        self._switch_lines: set[tuple[str, int]] = set()  # (file, line) that set a switch

    def install(self) -> None:
        watcher = self
        original_deterministic = torch.use_deterministic_algorithms

        @functools.wraps(original_deterministic)
        def use_deterministic_algorithms(mode: bool, *, warn_only: bool = False) -> None:
            # Record what the script asks for, but only warn: an op that raises under strict mode
            # (max_unpool, put_ on the CPU; many more on CUDA) must not stop the audit at the first.
            watcher.requested_deterministic = (bool(mode), bool(warn_only))
            watcher.switch_set(sys._getframe(1))
            original_deterministic(mode, warn_only=True)

        torch.use_deterministic_algorithms = use_deterministic_algorithms

        original_threads = torch.set_num_threads

        @functools.wraps(original_threads)
        def set_num_threads(n: int) -> None:
            watcher.set_num_threads_called = True
            original_threads(n)

        torch.set_num_threads = set_num_threads  # type: ignore[assignment]
        self._watch_switches()

    def after_fork(self) -> None:
        """A fork inherits the switches its parent set, and the lines that set them."""

    def collect(self) -> dict[str, Any]:
        flags = DeterminismFlags.capture()
        deterministic, warn_only = flags.deterministic_algorithms, flags.warn_only
        if self.requested_deterministic is not None and self.requested_deterministic[0] == deterministic:
            warn_only = self.requested_deterministic[1]  # the probe turned a strict request into warn-only
        return {
            "hash_randomization": self.hash_randomization,
            "pythonhashseed": self.start_env[HASH_SEED_VAR],
            "cublas_workspace_config": flags.cublas_workspace_config,
            "deterministic_algorithms": deterministic,
            "warn_only": warn_only,
            "cudnn_benchmark": flags.cudnn_benchmark,
            "cudnn_deterministic": flags.cudnn_deterministic,
            "cudnn_allow_tf32": flags.cudnn_allow_tf32,
            "cuda_matmul_allow_tf32": flags.cuda_matmul_allow_tf32,
            "float32_matmul_precision": flags.float32_matmul_precision,
            "inductor_fallback_random": flags.inductor_fallback_random,
            "num_threads": torch.get_num_threads(),
            "set_num_threads_called": self.set_num_threads_called,
            "thread_env": {k: v for k, v in self.start_env.items() if k != HASH_SEED_VAR},
            "cuda_initialized": cuda_started(),
            "switch_statements": tuple(self._switch_statements()),
            "accumulation_statements": tuple(self._accumulation_statements()),
        }

    def switch_set(self, frame: Any) -> None:
        """A determinism switch was set: note the user's line that set it."""
        with contextlib.suppress(Exception):
            user = user_frame(frame)
            if user is not None and len(self._switch_lines) < 10_000:
                self._switch_lines.add((user.f_code.co_filename, user.f_lineno))

    def _watch_switches(self) -> None:
        """Note the lines that set cuDNN's ``benchmark``/``allow_tf32``/``deterministic``, cuBLAS's
        ``allow_tf32``, the float32 matmul precision (and, in ``install``, the deterministic
        algorithms): the statements setting them that the script's source holds on other lines
        did not run (``_switch_statements``)."""
        watcher = self
        cudnn_cls: Any = type(torch.backends.cudnn)
        for name in ("benchmark", "allow_tf32", "deterministic"):
            prop = cudnn_cls.__dict__.get(name)
            if prop is None or not hasattr(prop, "__set__"):
                continue

            class _Noted:
                def __init__(self, prop: Any) -> None:
                    self.prop = prop

                def __get__(self, obj: Any, objtype: Any = None) -> Any:
                    return self.prop.__get__(obj, objtype)

                def __set__(self, obj: Any, value: Any) -> None:
                    watcher.switch_set(sys._getframe(1))
                    self.prop.__set__(obj, value)

            setattr(cudnn_cls, name, _Noted(prop))
        matmul_cls: Any = type(torch.backends.cuda.matmul)
        original_setattr = matmul_cls.__setattr__

        def setattr_(obj: Any, name: str, value: Any) -> Any:
            if name == "allow_tf32":
                watcher.switch_set(sys._getframe(1))
            return original_setattr(obj, name, value)

        matmul_cls.__setattr__ = setattr_
        original_precision = torch.set_float32_matmul_precision

        @functools.wraps(original_precision)
        def set_float32_matmul_precision(precision: str) -> None:
            watcher.switch_set(sys._getframe(1))
            original_precision(precision)

        torch.set_float32_matmul_precision = set_float32_matmul_precision

    def _user_files(self) -> list[str]:
        """The script and the modules imported from its directory tree (not installed packages,
        not torchrepro), as their code names them."""
        main = sys.modules.get("__main__")
        script = getattr(main, "__file__", None)
        if not isinstance(script, str):
            return []
        root = os.path.dirname(os.path.abspath(script)) + os.sep
        files = [script]
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if not isinstance(path, str) or not path.endswith(".py") or path == script:
                continue
            absolute = os.path.abspath(path)
            parts = absolute.split(os.sep)
            if (
                absolute.startswith(root)
                and not absolute.startswith(_TORCHREPRO_DIR)
                and "site-packages" not in parts
                and "dist-packages" not in parts
            ):
                files.append(path)
        return files[:200]

    def _accumulation_statements(self) -> list[dict[str, Any]]:
        """The user's files' calls that accumulate gradients under stock DDP or FSDP2."""
        out = []
        for filename in self._user_files():
            with contextlib.suppress(Exception):
                for statement in accumulation_statements(filename):
                    record = {k: v for k, v in statement.items() if k != "line"}
                    out.append({**record, "location": f"{shown(filename)}:{statement['line']}"})
        return out

    def _switch_statements(self) -> list[dict[str, Any]]:
        """The switch statements of the user's files, each with whether it ran (its line set a
        switch in this process)."""
        out = []
        for filename in self._user_files():
            with contextlib.suppress(Exception):
                for statement in switch_statements(filename):
                    lines = range(statement["line"], statement["end_line"] + 1)
                    ran = any((filename, n) in self._switch_lines for n in lines)
                    record = {k: v for k, v in statement.items() if k not in ("line", "end_line")}
                    out.append({**record, "location": f"{shown(filename)}:{statement['line']}", "ran": ran})
        return out
