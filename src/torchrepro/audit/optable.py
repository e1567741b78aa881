"""The op table: which aten ops ``torch.use_deterministic_algorithms`` documents, by torch release.

Invariants:
- The table is data (``ops_table.json``), keyed by torch release: each entry names the items of
  ``torch.use_deterministic_algorithms.__doc__`` it covers (``doc``), the aten ops that implement
  them, an optional condition on their arguments, and the fix. ``_load_table`` takes the
  installed release's table, else the newest older one (``exact`` False: TR001).
- ``_documented_items`` reads the installed torch's documentation; a test keeps the table equal
  to it, and an audit reports items the table lacks (TR002).
- Reading only: nothing here judges ops (``audit.op_rules``) or changes global state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

_TABLE_FILE = Path(__file__).with_name("ops_table.json")


@dataclasses.dataclass(frozen=True)
class _OpSpec:
    name: str  # "aten.cumsum"
    overload: str | None  # "dim" or None for any overload
    phase: str  # forward | backward | any


@dataclasses.dataclass(frozen=True)
class _Entry:
    code: str
    title: str
    section: str  # raises | deterministic | extra
    doc: tuple[str, ...]
    ops: tuple[_OpSpec, ...]
    condition: Mapping[str, Any] | None
    fix: str
    why: str | None


@dataclasses.dataclass(frozen=True)
class _OpTable:
    release: str
    exact: bool
    entries: tuple[_Entry, ...]
    cublas_ops: frozenset[str]


def _release_of(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot read a torch release from version {version!r}")
    return int(m.group(1)), int(m.group(2))


@functools.lru_cache(maxsize=4)
def _load_table(torch_version: str | None = None) -> _OpTable:
    """The op table for ``torch_version`` (default: installed): that release's, else the newest older one."""
    version = torch_version or torch.__version__
    data = json.loads(_TABLE_FILE.read_text(encoding="utf-8"))
    releases = sorted(data["releases"], key=_release_of)
    want = _release_of(version)
    older = [r for r in releases if _release_of(r) <= want]
    release = older[-1] if older else releases[0]
    raw = data["releases"][release]
    entries = []
    for e in raw["entries"]:
        ops = []
        for o in e["ops"]:
            parts = o["op"].split(".")
            ops.append(_OpSpec(".".join(parts[:2]), parts[2] if len(parts) > 2 else None, o["phase"]))
        entries.append(
            _Entry(
                code=e["code"],
                title=e["title"],
                section=e["section"],
                doc=tuple(e["doc"]),
                ops=tuple(ops),
                condition=e.get("condition"),
                fix=e["fix"],
                why=e.get("why"),
            )
        )
    return _OpTable(release, _release_of(release) == want, tuple(entries), frozenset(raw["cublas_ops"]))


_DOC_HEAD = re.compile(
    r"The following normally-nondeterministic operations will\s+"
    r"(act\s+deterministically|throw\s+a\s+:class:`RuntimeError`)\s+when\s+``mode=True``:[ \t]*\n"
)


def _documented_items(doc: str | None = None) -> dict[str, str]:
    """Items of ``torch.use_deterministic_algorithms.__doc__``: text -> ``raises`` or ``deterministic``.

    An item is a ``*`` bullet with its indented continuation lines (sub-bullets included), its
    whitespace collapsed to single spaces.
    """
    text = (torch.use_deterministic_algorithms.__doc__ or "") if doc is None else doc
    items: dict[str, str] = {}
    for m in _DOC_HEAD.finditer(text):
        section = "deterministic" if m.group(1).startswith("act") else "raises"
        current: list[str] | None = None
        indent = 0
        found: list[list[str]] = []
        for line in text[m.end() :].splitlines():
            stripped = line.strip()
            width = len(line) - len(line.lstrip())
            if stripped.startswith("* "):
                current, indent = [stripped[2:]], width
                found.append(current)
            elif not stripped:
                continue
            elif current is not None and width > indent:
                current.append(stripped)
            else:
                break
        for parts in found:
            items[" ".join(" ".join(parts).split())] = section
    return items
