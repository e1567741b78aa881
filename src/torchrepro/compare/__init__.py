"""Comparing two runs: event streams aligned rank by rank, the first divergence, what differs.

One module per job: ``alignment`` (``RankCursor``, ``first_divergence``, ``world_cursor``, what was
compared), ``differences`` (how far the first differing tensor is apart), ``settings`` (how two
records were started differently; their environments), ``runs`` (``compare_runs``). The result
types live in ``torchrepro.results``, the verdict's words in ``torchrepro.verdict``, locating in
op traces in ``torchrepro.tracing.locate``. Submodules load lazily on first use of a name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro.compare.alignment import (
        RankCursor,
        coverage,
        first_divergence,
        optimizer_steps,
        steps_compared,
        world_cursor,
    )
    from torchrepro.compare.differences import leaf_difference, recorded_numbers, tensor_difference
    from torchrepro.compare.runs import compare_runs
    from torchrepro.compare.settings import (
        env_difference_dict,
        environment_differences,
        explaining_setting,
        is_volatile,
        setting_differences,
    )

__all__ = [
    "RankCursor",
    "compare_runs",
    "coverage",
    "env_difference_dict",
    "environment_differences",
    "explaining_setting",
    "first_divergence",
    "is_volatile",
    "leaf_difference",
    "optimizer_steps",
    "recorded_numbers",
    "setting_differences",
    "steps_compared",
    "tensor_difference",
    "world_cursor",
]

_SUBMODULES: dict[str, str] = {
    "RankCursor": "alignment",
    "compare_runs": "runs",
    "coverage": "alignment",
    "env_difference_dict": "settings",
    "environment_differences": "settings",
    "explaining_setting": "settings",
    "first_divergence": "alignment",
    "is_volatile": "settings",
    "leaf_difference": "differences",
    "optimizer_steps": "alignment",
    "recorded_numbers": "differences",
    "setting_differences": "settings",
    "steps_compared": "alignment",
    "tensor_difference": "differences",
    "world_cursor": "alignment",
}

__getattr__, __dir__ = lazy_exports(__name__, _SUBMODULES, __all__)
