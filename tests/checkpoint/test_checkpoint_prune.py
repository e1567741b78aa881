"""prune_checkpoints: keep the newest N checkpoints by the save clock inside them, remove the
rest, and never touch what is not a readable torchrepro checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import torchrepro


@pytest.mark.usefixtures("rng_changes_ok")  # building the model draws its initial weights
def test_keeps_the_newest_by_save_clock_not_by_name_or_mtime(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    names = ["c.pt", "a.pt", "e.pt", "b.pt", "d.pt"]  # saved in this order
    for step, name in enumerate(names):
        torchrepro.save_checkpoint(tmp_path / name, model=model, step=step)
    os.utime(tmp_path / "c.pt", (4e9, 4e9))  # the oldest save, touched last: mtime does not count
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "broken.pt").write_bytes(b"PK\x03\x04 not really")
    removed = torchrepro.prune_checkpoints(tmp_path, keep=2)
    assert [Path(p).name for p in removed] == ["c.pt", "a.pt", "e.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.pt", "broken.pt", "d.pt", "notes.txt"]
    with pytest.warns(torchrepro.ReproWarning, match=r"broken\.pt"):  # latest_checkpoint names it
        latest = torchrepro.latest_checkpoint(tmp_path)
    assert torchrepro.load_checkpoint(latest, model=model, restore_rng=False) == {"step": 4}
    assert torchrepro.prune_checkpoints(tmp_path, keep=2) == []  # nothing more to remove
    assert torchrepro.prune_checkpoints(tmp_path / "missing", keep=1) == []


@pytest.mark.parametrize("keep", [0, -1, 1.5, True, "2"])
def test_keep_must_be_a_positive_int(tmp_path: Path, keep: object) -> None:
    with pytest.raises(ValueError, match=r"keep=\.\.\.\) must be an int >= 1"):
        torchrepro.prune_checkpoints(tmp_path, keep=keep)  # type: ignore[arg-type]


def test_records_directory_gets_a_gitignore_once(tmp_path: Path) -> None:
    from torchrepro import runrecord

    run = runrecord.new_run_dir(tmp_path / ".torchrepro" / "runs")
    ignore = tmp_path / ".torchrepro" / ".gitignore"
    assert run.parent.parent == ignore.parent
    assert ignore.read_text() == runrecord.RECORDS_GITIGNORE and "*" in ignore.read_text().splitlines()
    ignore.write_text("user's own\n")
    runrecord.new_run_dir(tmp_path / ".torchrepro" / "checks")
    assert ignore.read_text() == "user's own\n"  # never overwritten
    other = runrecord.new_run_dir(tmp_path / "elsewhere")
    assert not (other.parent / ".gitignore").exists()  # only a .torchrepro directory gets one
