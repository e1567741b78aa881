"""The HTML report of a check or a comparison: one self-contained page a person can look at.

``check --report out.html`` and ``compare --report out.html`` write it (``write_check_report``,
``write_compare_report``); ``pytest --torchrepro-report DIR`` writes one per failing test. One
module per job: ``distances`` (how far two runs are apart, step by step), ``data`` (what a page
shows, from a verdict and the records: ``ReportData``), ``svg`` (the distance plot), ``html`` (the
page, written atomically, never over a file that is not a report). Submodules load lazily on first
use of a name. Standard library only, apart from what the check and compare modules import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrepro._lazy import lazy_exports

if TYPE_CHECKING:
    from torchrepro.report.data import ReportData, check_report_data, compare_report_data, source_excerpt
    from torchrepro.report.distances import Series, StepDistance, distance_series
    from torchrepro.report.html import (
        GENERATOR,
        check_report_path,
        render_report,
        write_check_report,
        write_compare_report,
    )

__all__ = [
    "GENERATOR",
    "ReportData",
    "Series",
    "StepDistance",
    "check_report_data",
    "check_report_path",
    "compare_report_data",
    "distance_series",
    "render_report",
    "source_excerpt",
    "write_check_report",
    "write_compare_report",
]

_SUBMODULES: dict[str, str] = {
    "GENERATOR": "html",
    "ReportData": "data",
    "Series": "distances",
    "StepDistance": "distances",
    "check_report_data": "data",
    "check_report_path": "html",
    "compare_report_data": "data",
    "distance_series": "distances",
    "render_report": "html",
    "source_excerpt": "data",
    "write_check_report": "html",
    "write_compare_report": "html",
}

__getattr__, __dir__ = lazy_exports(__name__, _SUBMODULES, __all__)
