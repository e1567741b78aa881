"""The op table (``audit.optable``): op lists read from the installed torch's documentation (or
torchrepro's copy of a release's), hints kept as data keyed by op."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from torchrepro.audit.optable import _GENERIC_FIX, _TABLE_FILE, _documented_items, _release_of, load_table

# --------------------------------------------------------------------------------------------
# The op lists come from the installed torch's documentation; the hints are data, keyed by op


def _copies() -> dict[str, dict[str, str]]:
    """torchrepro's copy of each release's documented items: release -> item -> section."""
    data = json.loads(_TABLE_FILE.read_text())["documentation"]
    return {r: {i: s for s in ("raises", "deterministic") for i in data[r][s]} for r in data}


def _hintless(table: Any) -> list[str]:
    """Documented items with no entry, or whose entry has no hint for the section they are in there."""
    missing = [f"no entry: {item}" for item in table.uncovered]
    for e in table.entries:
        if e.fix == _GENERIC_FIX.get(e.section):
            missing += [f"no {e.section} hint in {e.code}: {item}" for item in e.doc]
    return sorted(missing)


def test_every_item_the_installed_torch_documents_has_ops_and_a_hint() -> None:
    documented = _documented_items()
    assert len(documented) >= 40, "the parser found too few items: did the documentation's layout change?"
    table = load_table()
    assert table.read and table.exact and table.listed_in == f"torch {table.release} documentation"
    assert _hintless(table) == [], f"torch {torch.__version__} documents ops the table has no hint for"


def test_every_item_of_every_copy_has_ops_and_a_hint_and_every_entry_item_is_documented() -> None:
    copies = _copies()
    for release in copies:
        table = load_table(f"{release}.0")
        assert (table.release, table.read) == (release, False)
        assert _hintless(table) == [], f"torch {release} (copy) documents ops the table has no hint for"
    ever = {item for documented in copies.values() for item in documented} | set(_documented_items())
    raw = json.loads(_TABLE_FILE.read_text())["entries"]
    stale = sorted(d for e in raw for d in e.get("doc", ()) if d not in ever)
    assert stale == [], f"in the table but documented by no release: {stale}"
    for e in raw:
        for o in e["ops"]:
            assert set(o.get("doc", ())) <= set(e.get("doc", ())), (e["code"], o["op"])


def test_the_copy_of_the_installed_release_equals_its_documentation() -> None:
    release = ".".join(torch.__version__.split(".")[:2])
    copies = _copies()
    if release not in copies:
        pytest.skip(f"torchrepro keeps no copy of torch {release}'s documentation")
    assert copies[release] == _documented_items()


def test_table_entries_are_well_formed_and_name_real_aten_ops() -> None:
    table = load_table()
    keys = [(e.code, e.section) for e in table.entries]
    assert len(keys) == len(set(keys))
    for entry in table.entries:
        assert entry.section in ("raises", "deterministic", "unguarded", "extra")
        if not (entry.listed_in or "").startswith("measured on "):  # a measurement cites a run, not items
            assert (entry.section == "extra") == (not entry.doc), entry.code
        assert entry.fix and entry.title and entry.ops
        for spec in entry.ops:
            assert spec.phase in ("forward", "backward", "any")
            ns, name = spec.name.split(".")
            assert ns == "aten"
            if entry.section == "extra" and not hasattr(torch.ops.aten, name):
                continue  # an extra entry may name kernels of newer releases (SDPA variants)
            packet = getattr(torch.ops.aten, name)  # raises if torch has no such op
            if spec.overload is not None:
                assert spec.overload in packet.overloads(), (
                    f"{entry.code}: no overload {spec.overload} of {name}"
                )
    for name in table.cublas_ops:
        getattr(torch.ops.aten, name.split(".")[1])
    # every measurement names an op of an entry, a section with a hint there, and the run
    ops_of = {o["op"]: e for e in json.loads(_TABLE_FILE.read_text())["entries"] for o in e["ops"]}
    for m in json.loads(_TABLE_FILE.read_text())["measured"]["ops"]:
        assert m["op"] in ops_of, m
        assert (
            m["section"] in ("raises", "deterministic", "unguarded")
            and m["section"] in ops_of[m["op"]]["fix"]
        )
        assert _release_of(m["since"]) and "gpu_validation.py" in m["seen"]
    raw = json.loads(_TABLE_FILE.read_text())
    assert raw["schema"] == 2 and all(r.count(".") == 1 for r in raw["documentation"])
    for e in raw["entries"]:
        assert set(e["fix"]) <= {"raises", "deterministic", "unguarded", "extra"}, e["code"]
        assert ("extra" in e["fix"]) == (not e.get("doc")), e["code"]


def test_doc_parser_reads_multiline_items_and_sub_bullets() -> None:
    doc = """Intro.

    The following normally-nondeterministic operations will act
    deterministically when ``mode=True``:

        * :class:`torch.nn.Conv1d` when called on CUDA tensor
        * :func:`torch.Tensor.__getitem__` when attempting to differentiate a CPU tensor
          and the index is a list of tensors

    The following normally-nondeterministic operations will throw a
    :class:`RuntimeError` when ``mode=True``:

        * :func:`torch.nn.functional.interpolate` when attempting to differentiate a CUDA tensor
          and one of the following modes is used:

          - ``linear``
          - ``bilinear``

        * :func:`torch.histc` when called on a CUDA tensor

    In addition, several operations fill uninitialized memory.
    """
    assert _documented_items(doc) == {
        ":class:`torch.nn.Conv1d` when called on CUDA tensor": "deterministic",
        ":func:`torch.Tensor.__getitem__` when attempting to differentiate a CPU tensor and the index is a "
        "list of tensors": "deterministic",
        ":func:`torch.nn.functional.interpolate` when attempting to differentiate a CUDA tensor and one of "
        "the following modes is used: - ``linear`` - ``bilinear``": "raises",
        ":func:`torch.histc` when called on a CUDA tensor": "raises",
    }


def _newest_copy() -> str:
    return max(json.loads(_TABLE_FILE.read_text())["documentation"], key=_release_of)


def test_table_for_an_unknown_release_falls_back_to_the_newest_copy_at_or_below_it() -> None:
    newest = _newest_copy()
    table = load_table("99.1.0")
    assert (table.release, table.exact, table.read) == (newest, False, False)
    assert table.listed_in == f"torchrepro's copy of the torch {newest} documentation"
    assert load_table("2.13.5").release == "2.13" and load_table("2.13.5").exact
    assert load_table("2.12.0").release == "2.4" and not load_table("2.12.0").exact
    assert load_table("1.13.0").release == "2.4"  # below every copy: the oldest
