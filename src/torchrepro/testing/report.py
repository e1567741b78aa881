"""What ``pytest --torchrepro-report DIR`` writes for a test that failed a reproducibility check.

Invariants: one report per failing test, named after its test id (``report_name``: characters
outside ``[A-Za-z0-9._-]`` become ``_``, long ids are cut and keep a digest of the whole id, so two
ids never share a file); a report is the verdicts as JSON (``<name>.json``: the ``check --json``
object of every check the test made) and the assertion's message as text (``<name>.txt``),
written atomically, and the HTML report (``torchrepro.report``, what ``check --report`` writes) of
each check that did not pass (``<name>.html``; ``<name>-<k>.html`` for the k-th of several).
``write_report`` is the one entry point.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from torchrepro._io import atomic_write_bytes, atomic_write_json
from torchrepro.errors import ReproAssertionError

__all__ = ["report_name", "write_report"]

REPORT_FORMAT = 1
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 120


def report_name(test_id: str) -> str:
    """A file name (without suffix) for ``test_id``: readable, safe on every file system."""
    name = _UNSAFE.sub("_", test_id).strip("._") or "test"
    if name != test_id or len(name) > _MAX_NAME:  # keep ids that map to the same text apart
        digest = hashlib.sha256(test_id.encode("utf-8")).hexdigest()[:10]
        name = f"{name[:_MAX_NAME]}-{digest}"
    return name


def report_data(test_id: str, failure: ReproAssertionError) -> dict[str, Any]:
    """The JSON report of ``failure`` in test ``test_id``."""
    return {
        "format": REPORT_FORMAT,
        "test": test_id,
        "target": failure.target,
        "message": str(failure),
        "checks": [
            {"vary": _jsonable(vary), **result.to_dict(), "check_dir": os.path.abspath(result.check_dir)}
            for vary, result in zip(failure.varied, failure.results, strict=True)
        ],
    }


def _jsonable(vary: object) -> object:
    """A ``vary`` value in JSON (a function variant's path arguments as strings)."""
    return json.loads(json.dumps(vary, default=os.fspath))


def write_report(directory: str | os.PathLike[str], test_id: str, failure: ReproAssertionError) -> list[Path]:
    """Write the report of ``failure`` (raised in test ``test_id``) into ``directory``; return the
    paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    name = report_name(test_id)
    paths = [out / f"{name}.json", out / f"{name}.txt"]
    atomic_write_json(paths[0], report_data(test_id, failure))
    atomic_write_bytes(paths[1], f"{test_id}\n{failure}\n".encode())
    from torchrepro.report import write_check_report

    failed = [r for r in failure.results if not r.outcome.passed]
    for k, result in enumerate(failed):
        paths.append(
            write_check_report(out / (f"{name}.html" if len(failed) == 1 else f"{name}-{k}.html"), result)
        )
    return paths
