"""The op table (``audit.optable``) is data, kept equal to the installed torch's documentation."""

from __future__ import annotations

import json

import torch

from torchrepro.audit.optable import _TABLE_FILE, _documented_items, _load_table

# --------------------------------------------------------------------------------------------
# The table is data, kept equal to the installed torch's documentation


def test_table_covers_exactly_the_documented_items_of_the_installed_torch() -> None:
    documented = _documented_items()
    assert len(documented) >= 40, "the parser found too few items: did the documentation's layout change?"
    table = _load_table()
    assert table.exact, f"no table for torch {torch.__version__}: add a release to {_TABLE_FILE.name}"
    covered: dict[str, str] = {}
    for entry in table.entries:
        for item in entry.doc:
            assert item not in covered, f"{item!r} is covered twice ({covered.get(item)} and {entry.code})"
            covered[item] = entry.code
            # an entry that raises may also cover the same op's made-deterministic item (put_ on CPU)
            allowed = {"raises", "deterministic"} if entry.section == "raises" else {entry.section}
            assert documented.get(item) in allowed, f"{entry.code}: {item!r} is not a {entry.section} item"
    missing = sorted(set(documented) - set(covered))
    stale = sorted(set(covered) - set(documented))
    assert missing == [], f"documented by torch {torch.__version__} but not in the table: {missing}"
    assert stale == [], f"in the table but no longer documented by torch {torch.__version__}: {stale}"


def test_table_entries_are_well_formed_and_name_real_aten_ops() -> None:
    table = _load_table()
    codes = [e.code for e in table.entries]
    assert len(codes) == len(set(codes))
    for entry in table.entries:
        assert entry.section in ("raises", "deterministic", "extra")
        assert (entry.section == "extra") == (not entry.doc), entry.code
        assert entry.fix and entry.title and entry.ops
        for spec in entry.ops:
            assert spec.phase in ("forward", "backward", "any")
            ns, name = spec.name.split(".")
            assert ns == "aten"
            packet = getattr(torch.ops.aten, name)  # raises if torch has no such op
            if spec.overload is not None:
                assert spec.overload in packet.overloads(), (
                    f"{entry.code}: no overload {spec.overload} of {name}"
                )
    for name in table.cublas_ops:
        getattr(torch.ops.aten, name.split(".")[1])
    raw = json.loads(_TABLE_FILE.read_text())
    assert set(raw["releases"]) and all(r.count(".") == 1 for r in raw["releases"])


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


def test_table_for_an_unknown_release_falls_back_to_the_newest_older_one() -> None:
    newest = max(json.loads(_TABLE_FILE.read_text())["releases"], key=lambda r: tuple(map(int, r.split("."))))
    table = _load_table("99.1.0")
    assert (table.release, table.exact) == (newest, False)
