"""torchrepro: bit-for-bit reproducible PyTorch training, and where and why runs part.

Importing torchrepro imports torch and the standard library only (NumPy when installed);
optional extras are imported lazily by the functions that need them.
"""

from torchrepro.audit import AuditReport, Finding, audit_ops, audit_script
from torchrepro.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from torchrepro.data import SeededLoader, sample_rng
from torchrepro.env import EnvDifference, Environment, collect_env, diff_env, load_env
from torchrepro.errors import (
    CheckpointError,
    DataLoaderStateError,
    DeterminismError,
    EnvFileError,
    LaunchError,
    ReproError,
    ReproWarning,
    RngStateError,
    TraceError,
)
from torchrepro.fingerprint import fingerprint
from torchrepro.flags import DeterminismFlags, StatusReport, reproducible, set_determinism, status
from torchrepro.launch import relaunch
from torchrepro.record import record
from torchrepro.rng import RngState, fork_rng
from torchrepro.seeding import derive_seed, seed_everything
from torchrepro.trace import compare_traces, trace

__version__ = "0.1.0"

__all__ = [
    "AuditReport",
    "CheckpointError",
    "DataLoaderStateError",
    "DeterminismError",
    "DeterminismFlags",
    "EnvDifference",
    "EnvFileError",
    "Environment",
    "Finding",
    "LaunchError",
    "ReproError",
    "ReproWarning",
    "RngState",
    "RngStateError",
    "SeededLoader",
    "StatusReport",
    "TraceError",
    "__version__",
    "audit_ops",
    "audit_script",
    "collect_env",
    "compare_traces",
    "derive_seed",
    "diff_env",
    "fingerprint",
    "fork_rng",
    "latest_checkpoint",
    "load_checkpoint",
    "load_env",
    "record",
    "relaunch",
    "reproducible",
    "sample_rng",
    "save_checkpoint",
    "seed_everything",
    "set_determinism",
    "status",
    "trace",
]
