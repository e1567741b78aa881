"""The audit's op table: which ops break determinism under this torch, with curated hints.

Invariants:

- Which ops raise under ``torch.use_deterministic_algorithms(True)`` and which it makes
  deterministic comes from the installed torch's own documentation (the items of
  ``torch.use_deterministic_algorithms.__doc__``), never from a list made for another release.
- ``ops_table.json`` holds what the documentation does not say, keyed by op, not by release: the
  aten ops behind each documented item, conditions on the call, and a fix hint for each section
  (``raises``, ``deterministic``) an op is in, in any release.
- What a GPU showed where the documentation is wrong (``measured`` in the table: an op made
  deterministic that the documentation lists as raising, an op that raises that it does not list,
  an op strict mode does not stop) overrides the documented section of that op from the measured
  release on, with the measurement cited (``Entry.listed_in``); older releases keep the lists.
- When the installed torch's documentation cannot be read, the lists are torchrepro's copy of the
  newest release at or below it (``documentation`` in the table), and the table says so
  (``_OpTable.read`` is false, ``_OpTable.listed_in`` names the copy).
- Every entry the table returns carries where its list comes from (``Entry.listed_in``), for the
  findings to cite. Nothing here changes global state.
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
_SECTIONS = ("raises", "deterministic")
# A hint for a section the table has none for (the tests fail on it, naming the item).
_GENERIC_FIX = {
    "raises": "This torch documents no deterministic implementation of this op: run it on the CPU, or "
    "replace it (and add a hint to torchrepro/audit/ops_table.json).",
    "deterministic": "Run under strict mode (torchrepro run, or torch.use_deterministic_algorithms(True)); "
    "PyTorch then uses a deterministic implementation, at some speed cost.",
    "unguarded": "Strict mode does not stop this op: replace it, or run it on the CPU.",
}


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str  # "aten.cumsum"
    overload: str | None  # "dim" or None for any overload
    phase: str  # forward | backward | any


@dataclasses.dataclass(frozen=True)
class Entry:
    code: str
    title: str
    section: str  # raises | deterministic | unguarded (measured: strict mode runs it, bits vary) | extra
    doc: tuple[str, ...]  # the documented items behind it, in this release
    ops: tuple[OpSpec, ...]  # those of its ops that are in this section, in this release
    condition: Mapping[str, Any] | None
    fix: str
    why: str | None
    listed_in: str | None = None  # "torch 2.14 documentation", "measured on ..."; None for extra entries
    cpu: bool | None = None  # raises on the CPU too: True every item, None some, False CUDA only


@dataclasses.dataclass(frozen=True)
class _OpTable:
    release: str  # the release whose documentation the lists come from ("2.14")
    exact: bool  # that release is the one asked for
    entries: tuple[Entry, ...]
    cublas_ops: frozenset[str]
    read: bool = True  # the lists were read from torch's documentation, not from torchrepro's copy
    listed_in: str = ""  # "torch 2.14 documentation" or "torchrepro's copy of the torch 2.13 documentation"
    uncovered: tuple[str, ...] = ()  # documented items the table has no entry for


_ORDER = ("raises", "unguarded", "deterministic", "extra")  # the order of an entry's groups


def _measured(data: Mapping[str, Any], want: tuple[int, int]) -> dict[str, dict[str, str]]:
    """The table's measurements that hold for release ``want``: op ("aten.name[.overload]") -> record."""
    ops = data.get("measured", {}).get("ops", ())
    return {m["op"]: m for m in ops if _release_of(m["since"]) <= want}


def _release_of(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot read a torch release from version {version!r}")
    return int(m.group(1)), int(m.group(2))


def _table_data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(_TABLE_FILE.read_text(encoding="utf-8"))
    return data


def _curated(data: Mapping[str, Any], want: tuple[int, int]) -> tuple[str, dict[str, str]]:
    """torchrepro's copy of the documentation: the newest release at or below ``want`` (else the oldest)."""
    releases = sorted(data["documentation"], key=_release_of)
    older = [r for r in releases if _release_of(r) <= want]
    release = older[-1] if older else releases[0]
    lists = data["documentation"][release]
    return release, {item: section for section in _SECTIONS for item in lists[section]}


def _read_documentation(doc: str) -> dict[str, str] | None:
    """The documented items, or None when ``doc`` does not have both lists (its layout changed)."""
    items = _documented_items(doc)
    return items if set(items.values()) == set(_SECTIONS) else None


def _on_cpu(items: list[str]) -> bool | None:
    """Whether the ops of these raising items raise on the CPU too (None: for some items only)."""
    cuda_only = ["CUDA" in item and "CPU" not in item for item in items]
    return False if all(cuda_only) else True if not any(cuda_only) else None


@functools.lru_cache(maxsize=8)
def load_table(
    torch_version: str | None = None, doc: str | None = None, *, measured: bool = True
) -> _OpTable:
    """The op table for ``torch_version`` (default: the installed torch), its lists read from ``doc``.

    ``measured=False`` leaves out the GPU measurements: the documentation's lists as they are.

    ``doc`` defaults to the installed torch's ``use_deterministic_algorithms.__doc__`` when no
    version is given; for another version without ``doc``, or a ``doc`` that cannot be read, the
    lists are torchrepro's copy of the newest release at or below the version.
    """
    if torch_version is None:
        torch_version = torch.__version__
        if doc is None:
            doc = torch.use_deterministic_algorithms.__doc__ or ""
    want = _release_of(torch_version)
    data = _table_data()
    documented = None if doc is None else _read_documentation(doc)
    if documented is not None:
        release, read = f"{want[0]}.{want[1]}", True
        listed_in = f"torch {release} documentation"
    else:
        release, documented = _curated(data, want)
        read = False
        listed_in = f"torchrepro's copy of the torch {release} documentation"
    measurements = _measured(data, want) if measured else {}
    entries = []
    covered: set[str] = set()
    for e in data["entries"]:
        specs = []
        for o in e["ops"]:
            parts = o["op"].split(".")
            spec = OpSpec(".".join(parts[:2]), parts[2] if len(parts) > 2 else None, o["phase"])
            specs.append((spec, [d for d in o.get("doc", e.get("doc", ())) if d in documented]))
        condition, why = e.get("condition"), e.get("why")
        # (section, listed_in) -> (ops, documented items): each group is one Entry
        groups: dict[tuple[str, str | None], tuple[list[OpSpec], dict[str, None]]] = {}
        for spec, items in specs:
            seen = measurements.get(f"{spec.name}.{spec.overload}" if spec.overload else spec.name)
            if seen is not None:
                key: tuple[str, str | None] = (seen["section"], f"measured on {seen['seen']}")
            elif not e.get("doc"):
                key = ("extra", None)  # not in the documentation: always counted
            elif items:
                section = "raises" if any(documented[d] == "raises" for d in items) else "deterministic"
                key = (section, listed_in)
                items = [d for d in items if documented[d] == section]
            else:
                continue
            ops_of, items_of = groups.setdefault(key, ([], {}))
            ops_of.append(spec)
            items_of.update(dict.fromkeys(items))
        covered.update(d for d in e.get("doc", ()) if d in documented)
        for (section, source), (ops_of, items_of) in sorted(
            groups.items(), key=lambda g: _ORDER.index(g[0][0])
        ):
            entries.append(
                Entry(
                    code=e["code"],
                    title=e["title"],
                    section=section,
                    doc=tuple(items_of),
                    ops=tuple(ops_of),
                    condition=condition,
                    fix=e["fix"].get(section, _GENERIC_FIX.get(section, "")),
                    why=why,
                    listed_in=source,
                    cpu=(_on_cpu(list(items_of)) if source == listed_in else False)
                    if section == "raises"
                    else None,
                )
            )
    return _OpTable(
        release=release,
        exact=_release_of(release) == want,
        entries=tuple(entries),
        cublas_ops=frozenset(data["cublas_ops"]),
        read=read,
        listed_in=listed_in,
        uncovered=tuple(sorted(set(documented) - covered)),
    )


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
