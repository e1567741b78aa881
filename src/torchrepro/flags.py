"""Determinism switches: set them by mode, snapshot and restore them, report what falls short.

Invariants:
- ``set_determinism``, ``DeterminismFlags.restore`` and ``reproducible`` are the only functions in
  torchrepro that write ``os.environ`` or global torch flags (besides ``portable.disable_onednn``,
  portable mode's one switch); each validates before it changes anything, so an error leaves every
  switch as it was.
- ``DeterminismFlags.capture`` reads every switch (including ``CUBLAS_WORKSPACE_CONFIG``) and
  ``restore`` puts back exactly what was captured, unsetting the variable if it was unset.
- Nothing here initialises CUDA: whether CUDA has started is read with
  ``torch.cuda.is_initialized()``.
- ``status`` only reads; its report never calls a warn-only setup deterministic.

Modes (``set_determinism``):
- ``strict``: ``use_deterministic_algorithms(True)``, cuDNN deterministic and no benchmarking,
  TF32 off for matmul and cuDNN, float32 matmul precision ``"highest"`` (every per-backend
  ``fp32_precision`` back to its full-precision default), ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when
  unset, and ``torch.utils.deterministic.fill_uninitialized_memory=True`` (PyTorch's default:
  uninitialised memory from ``torch.empty`` and friends is filled with NaN / the largest integer,
  so a read of it is the same in every run; measured ~1.16x (median) on a small CPU CNN training
  step and ~2x on an allocation-bound loop, see ``benchmarks/fill_uninitialized_memory.py``), and
  Inductor's ``fallback_random`` (a compiled graph draws its random numbers with eager's ops from
  the global generator, so ``torch.compile`` keeps eager's dropout masks; set when Inductor's config
  is imported, never importing it: ``_imports.when_imported``).
- ``warn``: the same switches with ``warn_only=True``: ops with no deterministic kernel warn and
  still run nondeterministically.
- ``off``: PyTorch's defaults (``CUBLAS_WORKSPACE_CONFIG`` is left as it is).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from torchrepro import _runtime, seeding
from torchrepro._compat import lazy_import
from torchrepro._imports import when_imported
from torchrepro.errors import DeterminismError, ReproWarning, warn_once
from torchrepro.seeding import seed_everything, validate_seed

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")  # imported on first use: the CLI parent needs only the constants

__all__ = [
    "CUBLAS_CONFIGS",
    "CUBLAS_VAR",
    "FLASH_ATTENTION_VAR",
    "MODES",
    "DeterminismFlags",
    "cublas_start_value",
    "reproducible",
    "set_determinism",
]

MODES = ("strict", "warn", "off")
"""The modes ``set_determinism`` accepts."""

CUBLAS_VAR = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_CONFIGS = (":4096:8", ":16:8")
"""The values of ``CUBLAS_WORKSPACE_CONFIG`` PyTorch accepts as deterministic."""

FLASH_ATTENTION_VAR = "FLASH_ATTENTION_DETERMINISTIC"
"""Read at each call by transformers' flash-attn integration: ``"1"`` makes the flash-attn
package's backward deterministic (its default accumulates with atomics). PyTorch's own SDPA
kernels follow ``use_deterministic_algorithms`` instead."""

# Per-backend float32 precision switches of newer PyTorch (torch.backends.*.fp32_precision),
# parents before children so that restoring in this order reproduces the captured tree.
_FP32_NODES = (
    ("generic", ()),
    ("cuda.matmul", ("cuda", "matmul")),
    ("cudnn", ("cudnn",)),
    ("cudnn.conv", ("cudnn", "conv")),
    ("cudnn.rnn", ("cudnn", "rnn")),
    ("mkldnn", ("mkldnn",)),
    ("mkldnn.matmul", ("mkldnn", "matmul")),
    ("mkldnn.conv", ("mkldnn", "conv")),
    ("mkldnn.rnn", ("mkldnn", "rnn")),
)
_FP32_DEFAULT = "none"  # "use the parent's precision"; at the root: full float32
FP32_FULL_PRECISION = ("none", "ieee")
"""The float32 matmul/conv precision values that keep full float32 (TF32 off)."""


def _fp32_node(path: tuple[str, ...]) -> Any:
    node: Any = torch.backends
    for part in path:
        node = getattr(node, part)
    return node


def _has_fp32_tree() -> bool:
    return hasattr(torch.backends, "fp32_precision")


def _read_fp32_tree() -> tuple[tuple[str, str], ...]:
    if not _has_fp32_tree():
        return ()
    return tuple((name, str(_fp32_node(path).fp32_precision)) for name, path in _FP32_NODES)


def _write_fp32_tree(tree: tuple[tuple[str, str], ...]) -> None:
    paths = dict(_FP32_NODES)
    for name, value in tree:
        if name in paths:
            _fp32_node(paths[name]).fp32_precision = value


def _legacy(read: Any) -> Any:
    """Read a legacy TF32 switch; ``None`` when torch refuses (legacy and new APIs were mixed)."""
    try:
        return read()
    except RuntimeError:
        return None


def _fill_uninitialized_memory() -> bool:
    return bool(torch.utils.deterministic.fill_uninitialized_memory)  # type: ignore[attr-defined]


def _set_fill_uninitialized_memory(value: bool) -> None:
    torch.utils.deterministic.fill_uninitialized_memory = value  # type: ignore[attr-defined]


@dataclass(frozen=True)
class DeterminismFlags:
    """A snapshot of every determinism switch; ``restore()`` puts them all back.

    ``cuda_matmul_allow_tf32``, ``cudnn_allow_tf32`` and ``float32_matmul_precision`` are ``None``
    when PyTorch refuses to report them because its legacy and per-backend precision APIs were
    mixed; ``fp32_precision`` holds the per-backend values (empty on PyTorch without them).

    >>> flags = DeterminismFlags.capture()
    >>> torch.backends.cudnn.benchmark = not flags.cudnn_benchmark
    >>> flags.restore()
    >>> DeterminismFlags.capture() == flags
    True
    """

    deterministic_algorithms: bool
    warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    cuda_matmul_allow_tf32: bool | None
    cudnn_allow_tf32: bool | None
    float32_matmul_precision: str | None
    fp32_precision: tuple[tuple[str, str], ...]
    fill_uninitialized_memory: bool
    cublas_workspace_config: str | None
    flash_attention_deterministic: str | None = None
    inductor_fallback_random: bool = False
    """Inductor's ``fallback_random``: its config's value once imported; before that the value
    waiting for the import (``set_determinism`` never imports Inductor), else its default, False."""

    @classmethod
    def capture(cls) -> DeterminismFlags:
        """Read every switch, including ``CUBLAS_WORKSPACE_CONFIG`` (``None`` when unset)."""
        return cls(
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            cuda_matmul_allow_tf32=_legacy(lambda: bool(torch.backends.cuda.matmul.allow_tf32)),
            cudnn_allow_tf32=_legacy(lambda: bool(torch.backends.cudnn.allow_tf32)),
            float32_matmul_precision=_legacy(torch.get_float32_matmul_precision),
            fp32_precision=_read_fp32_tree(),
            fill_uninitialized_memory=_fill_uninitialized_memory(),
            cublas_workspace_config=os.environ.get(CUBLAS_VAR),
            flash_attention_deterministic=os.environ.get(FLASH_ATTENTION_VAR),
            inductor_fallback_random=_inductor_fallback_random(),
        )

    def restore(self) -> None:
        """Put every switch back as captured; unset ``CUBLAS_WORKSPACE_CONFIG`` and
        ``FLASH_ATTENTION_DETERMINISTIC`` if they were unset."""
        _use_deterministic_algorithms(self.deterministic_algorithms, warn_only=self.warn_only)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        # The legacy switches are views of the per-backend tree plus a little hidden state: set
        # them first, then the tree. allow_tf32 for matmul is a view of the precision.
        if self.float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(self.float32_matmul_precision)
        elif self.cuda_matmul_allow_tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = self.cuda_matmul_allow_tf32
        if self.cudnn_allow_tf32 is not None:
            torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32
        _write_fp32_tree(self.fp32_precision)
        _set_fill_uninitialized_memory(self.fill_uninitialized_memory)
        if self.cublas_workspace_config is None:
            os.environ.pop(CUBLAS_VAR, None)
        elif os.environ.get(CUBLAS_VAR) != self.cublas_workspace_config:
            os.environ[CUBLAS_VAR] = self.cublas_workspace_config
        if self.flash_attention_deterministic is None:
            os.environ.pop(FLASH_ATTENTION_VAR, None)
        elif os.environ.get(FLASH_ATTENTION_VAR) != self.flash_attention_deterministic:
            os.environ[FLASH_ATTENTION_VAR] = self.flash_attention_deterministic
        _set_inductor_fallback_random(self.inductor_fallback_random or None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every switch (``fp32_precision`` as a ``{backend: value}`` dict)."""
        d = asdict(self)
        d["fp32_precision"] = dict(self.fp32_precision)
        return d


def _check_mode(mode: object) -> str:
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, one of {list(MODES)}; got {type(mode).__name__} {mode!r}.")
    if mode not in MODES:
        raise ValueError(f"Unknown determinism mode {mode!r}; use one of {list(MODES)}.")
    return mode


def cublas_fix() -> str:
    return (
        f"set {CUBLAS_VAR}={CUBLAS_CONFIGS[0]} (or {CUBLAS_CONFIGS[1]}) in the environment before the "
        "process starts, or start it with `torchrepro run`"
    )


_INDUCTOR_DETERMINISTIC = "TORCHINDUCTOR_DETERMINISTIC"
_INDUCTOR_CONFIG = "torch._inductor.config"
_fallback_random_waiting: bool | None = None
"""The ``fallback_random`` to set when Inductor's config is imported (None: leave it)."""


def _inductor_fallback_random() -> bool:
    """Inductor's ``fallback_random`` when its config is imported, else the value waiting for it."""
    config = sys.modules.get(_INDUCTOR_CONFIG)
    if config is None:
        return bool(_fallback_random_waiting)
    return bool(getattr(config, "fallback_random", False))


def _apply_fallback_random(config: Any) -> None:
    if hasattr(config, "fallback_random"):  # None: Inductor's default, as it was before the import
        config.fallback_random = bool(_fallback_random_waiting)


def _set_inductor_fallback_random(value: bool | None) -> None:
    """Set Inductor's ``fallback_random`` now if its config is imported, else when it is (importing
    Inductor costs about a second of start-up, and a script that never compiles never needs it).
    None: Inductor's default (False), and no value waits for the import."""
    global _fallback_random_waiting, _fallback_hooked
    _fallback_random_waiting = value
    config = sys.modules.get(_INDUCTOR_CONFIG)
    if config is not None:
        _apply_fallback_random(config)
    elif value is not None and not _fallback_hooked:
        _fallback_hooked = True  # one hook applies whatever value waits when the import happens
        when_imported(_INDUCTOR_CONFIG, _apply_fallback_random)


_fallback_hooked = False


def _use_deterministic_algorithms(mode: bool, *, warn_only: bool) -> None:
    """``torch.use_deterministic_algorithms`` without importing Inductor (about a second of start-up).

    torch's function also sets ``torch._inductor.config.deterministic``, importing Inductor and
    dynamo to do it. While Inductor is not imported, the same effect is had by setting the C++
    switch and ``TORCHINDUCTOR_DETERMINISTIC``, which Inductor's config reads when it is imported
    (a later ``torch.compile`` still compiles deterministically). Once Inductor is imported, or
    where ``torch.use_deterministic_algorithms`` was replaced (the audit's probe records the
    request), torch's function is called as it is.
    """
    function = torch.use_deterministic_algorithms
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if "torch._inductor.config" in sys.modules or hasattr(function, "__wrapped__") or setter is None:
        function(mode, warn_only=warn_only)
        return
    if mode:
        os.environ[_INDUCTOR_DETERMINISTIC] = "1"
    elif os.environ.get(_INDUCTOR_DETERMINISTIC) == "1":
        del os.environ[_INDUCTOR_DETERMINISTIC]
    setter(mode, warn_only=warn_only)


def set_determinism(mode: str = "strict") -> DeterminismFlags:
    """Set every determinism switch for ``mode`` and return the previous flags.

    ``"strict"``: deterministic algorithms (ops with no deterministic kernel raise), cuDNN
    deterministic, no cuDNN benchmarking, no TF32, float32 matmul precision ``"highest"``,
    ``fill_uninitialized_memory`` on, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless a valid value
    is already set, ``FLASH_ATTENTION_DETERMINISTIC=1`` (the flash-attn package's backward,
    through transformers), and Inductor's ``fallback_random`` (compiled random ops draw as eager's
    do; applied when Inductor's config is imported). ``"warn"``: the same, warn-only. ``"off"``:
    PyTorch's defaults (both variables left as they are).

    Raises ``DeterminismError`` in strict mode (warns in warn mode) when
    ``CUBLAS_WORKSPACE_CONFIG`` holds a value PyTorch does not accept, or is unset while CUDA has
    already started (cuBLAS reads it once, at start). Call ``.restore()`` on the result to undo.

    >>> previous = set_determinism("strict")
    >>> torch.are_deterministic_algorithms_enabled()
    True
    >>> previous.restore()
    """
    mode = _check_mode(mode)
    previous = DeterminismFlags.capture()
    set_cublas: str | None = None
    if mode != "off":
        set_cublas = _plan_cublas(mode, previous.cublas_workspace_config)
    # Nothing has been changed above this line.
    if mode == "off":
        _use_deterministic_algorithms(False, warn_only=False)
    else:
        _use_deterministic_algorithms(True, warn_only=mode == "warn")
    torch.backends.cudnn.deterministic = mode != "off"
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    cudnn_tf32 = mode == "off"  # PyTorch's default allows TF32 in cuDNN convolutions
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    if _has_fp32_tree():
        tree = tuple(
            (name, "tf32" if cudnn_tf32 and name in ("cudnn.conv", "cudnn.rnn") else _FP32_DEFAULT)
            for name, _ in _FP32_NODES
        )
        _write_fp32_tree(tree)
    _set_fill_uninitialized_memory(True)
    if set_cublas is not None:
        os.environ[CUBLAS_VAR] = set_cublas
    if mode != "off":
        os.environ[FLASH_ATTENTION_VAR] = "1"
    _set_inductor_fallback_random(True if mode != "off" else None)
    return previous


def cublas_start_value(mode: str, current: str | None) -> str | None:
    """The ``CUBLAS_WORKSPACE_CONFIG`` a process in ``mode`` must start with, when ``current`` (its
    value now, None: unset) is not one PyTorch accepts; None: leave it (mode ``off``, or valid).

    What ``relaunch`` puts in place (or re-executes with, once CUDA has started); ``set_determinism``
    sets the same value and also says when it is too late or invalid.
    """
    if mode == "off" or current in CUBLAS_CONFIGS:
        return None
    return CUBLAS_CONFIGS[0]


def _plan_cublas(mode: str, current: str | None) -> str | None:
    """Check ``CUBLAS_WORKSPACE_CONFIG``; return the value to set, or ``None`` to leave it."""
    if current is not None:
        if current in CUBLAS_CONFIGS:
            return None
        message = (
            f"{CUBLAS_VAR}={current!r} is not a value PyTorch accepts as deterministic; "
            f"expected {CUBLAS_CONFIGS[0]!r} or {CUBLAS_CONFIGS[1]!r}: {cublas_fix()}."
        )
        if mode == "strict":
            raise DeterminismError(message)
        warn_once(f"cublas-invalid:{current}", message, ReproWarning, stacklevel=3)
        return None
    if _runtime.cuda_started():
        message = (
            f"CUDA is already initialised and {CUBLAS_VAR} was not set, so cuBLAS may already use a "
            f"nondeterministic workspace: {cublas_fix()}."
        )
        if mode == "strict":
            raise DeterminismError(message)
        warn_once("cublas-after-cuda", message + " Setting it now; it may have no effect.", stacklevel=3)
    return cublas_start_value(mode, current)


@contextmanager
def reproducible(seed: int | None, mode: str = "strict") -> Iterator[int]:
    """Seed every RNG and set the determinism switches for the block; undo both on exit.

    Yields the seed used (``None`` draws a fresh one, like ``seed_everything``). On exit every
    RNG state (Python, NumPy, torch CPU and CUDA), every switch, ``CUBLAS_WORKSPACE_CONFIG`` and
    ``torchrepro.seeding.current_seed()`` are what they were before.

    >>> with reproducible(0, mode="off") as seed:
    ...     a = torch.rand(1)
    >>> with reproducible(seed, mode="off"):
    ...     torch.equal(a, torch.rand(1))
    True
    """
    mode = _check_mode(mode)
    if seed is not None:
        seed = validate_seed(seed)
    previous_seed = seeding.current_seed()
    from torchrepro.rng import isolated  # rng imports torch

    with isolated():
        previous = set_determinism(mode)
        try:
            yield seed_everything(seed)
        finally:
            previous.restore()
            seeding._current_seed = previous_seed
