"""torchrepro: bit-for-bit reproducible PyTorch training, and where and why runs part.

Invariants: ``import torchrepro`` imports nothing beyond the standard library until a name is
used; each public name loads the one submodule that holds it (PEP 562 ``__getattr__``), so
importing one part (``torchrepro.data``, ``torchrepro.seeding``) never pulls in another part's
dependencies (the tracing package and torch's dispatch internals load only for ``trace``).
``__all__`` is the public API contract (``docs/architecture.md``) plus the error classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro import testing  # noqa: F401
    from torchrepro._version import __version__  # noqa: F401
    from torchrepro.audit import AuditReport, Finding, audit_ops, audit_script  # noqa: F401
    from torchrepro.checkpoint import (
        latest_checkpoint,
        load_checkpoint,
        prune_checkpoints,
        save_checkpoint,
        wait_for_checkpoints,
    )
    from torchrepro.data import SeededLoader, ShardedDataset, sample_rng
    from torchrepro.env import EnvDifference, Environment, collect_env, diff_env, load_env  # noqa: F401
    from torchrepro.errors import (
        CheckpointError,
        CheckpointWriteError,
        DataLoaderStateError,
        DeterminismError,
        EnvFileError,
        InvariantTrainingError,
        LaunchError,
        LoaderConfigError,
        ReproAssertionError,
        ReproError,
        ReproWarning,
        RngStateError,
        SettingsError,
        ShardReadError,
        TraceError,
        UnsupportedDatasetError,
    )
    from torchrepro.flags import DeterminismFlags, reproducible, set_determinism
    from torchrepro.hashing import fingerprint
    from torchrepro.invariant import InvariantDataParallel, clip_grad_norm_
    from torchrepro.launch import relaunch
    from torchrepro.recorder import record
    from torchrepro.rng import RngState, fork_rng
    from torchrepro.seeding import derive_seed, seed_everything
    from torchrepro.status_report import StatusReport, status  # noqa: F401
    from torchrepro.tracing import compare_traces, trace

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "DataLoaderStateError",
    "DeterminismError",
    "DeterminismFlags",
    "EnvFileError",
    "InvariantDataParallel",
    "InvariantTrainingError",
    "LaunchError",
    "LoaderConfigError",
    "ReproAssertionError",
    "ReproError",
    "ReproWarning",
    "RngState",
    "RngStateError",
    "SeededLoader",
    "SettingsError",
    "ShardReadError",
    "ShardedDataset",
    "TraceError",
    "UnsupportedDatasetError",
    "clip_grad_norm_",
    "compare_traces",
    "derive_seed",
    "fingerprint",
    "fork_rng",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "record",
    "relaunch",
    "reproducible",
    "sample_rng",
    "save_checkpoint",
    "seed_everything",
    "set_determinism",
    "status",
    "trace",
    "wait_for_checkpoints",
]

# name -> the submodule that holds it. The names after the contract stay importable from the
# top level for convenience (they are documented in their modules), but are not in __all__.
_WHERE = {
    **dict.fromkeys(
        [
            "CheckpointError",
            "CheckpointWriteError",
            "DataLoaderStateError",
            "DeterminismError",
            "EnvFileError",
            "InvariantTrainingError",
            "LaunchError",
            "LoaderConfigError",
            "ReproAssertionError",
            "ReproError",
            "ReproWarning",
            "RngStateError",
            "SettingsError",
            "ShardReadError",
            "TraceError",
            "UnsupportedDatasetError",
        ],
        "errors",
    ),
    "DeterminismFlags": "flags",
    "reproducible": "flags",
    "set_determinism": "flags",
    "status": "status_report",
    "StatusReport": "status_report",
    "RngState": "rng",
    "fork_rng": "rng",
    "SeededLoader": "data",
    "ShardedDataset": "data",
    "InvariantDataParallel": "invariant",
    "clip_grad_norm_": "invariant",
    "sample_rng": "data",
    "latest_checkpoint": "checkpoint",
    "prune_checkpoints": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "wait_for_checkpoints": "checkpoint",
    "derive_seed": "seeding",
    "seed_everything": "seeding",
    "fingerprint": "hashing",
    "record": "recorder",
    "relaunch": "launch",
    "compare_traces": "tracing",
    "trace": "tracing",
    "AuditReport": "audit",
    "Finding": "audit",
    "audit_ops": "audit",
    "audit_script": "audit",
    "EnvDifference": "env",
    "Environment": "env",
    "collect_env": "env",
    "diff_env": "env",
    "load_env": "env",
    "__version__": "_version",
    "testing": "testing",  # a submodule: torchrepro.testing.assert_reproducible
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, [*__all__, "__version__", "testing"])
