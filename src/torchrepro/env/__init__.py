"""The environment fingerprint: everything outside the script that decides a run's bits.

One module per job: ``model`` (``Environment``, ``EnvDifference``: the data, its JSON form and its
validation; no torch), ``collect`` (``collect_env`` and its read-only probes), ``diff``
(``load_env``, and ``diff_env`` with its classification rules). Submodules load lazily on first
use of a public name: importing this package imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro.env.collect import collect_env
    from torchrepro.env.diff import diff_env, load_env
    from torchrepro.env.model import EnvDifference, Environment

__all__ = ["EnvDifference", "Environment", "collect_env", "diff_env", "load_env"]

_WHERE = {
    "EnvDifference": "model",
    "Environment": "model",
    "collect_env": "collect",
    "diff_env": "diff",
    "load_env": "diff",
}


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, __all__)
