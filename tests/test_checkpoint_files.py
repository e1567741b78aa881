"""Checkpoint files (issue 13): whatever sits at the path, whatever the disk does, whatever the
file declares, the answer is a CheckpointError naming the file and the cause, and a refused load
or save leaves the user's objects and the previous checkpoint as they were.

Every refusal is paired with the good case, and, where it shows something, with a control that
plain torch does what the issue describes (so the test cannot pass vacuously).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from torchrepro import load_checkpoint
from torchrepro import save_checkpoint as save
from torchrepro._io import TMP_SUFFIX, atomic_write_json

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # building modules draws from the torch RNG

# --------------------------------------------------------------------------- file modes


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002, 0o027], ids=lambda u: f"umask{u:03o}")
def test_files_get_the_mode_the_umask_gives(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        save(tmp_path / "c.pt", step=1)
        save(tmp_path / "c.pt", step=2)  # replacing a file too
        atomic_write_json(tmp_path / "record.json", {"a": 1})
        torch.save({"a": 1}, tmp_path / "plain.pt")  # control: what torch.save gives
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"c.pt": expected, "record.json": expected, "plain.pt": expected}
    assert not list(tmp_path.glob(f"*{TMP_SUFFIX}"))
    assert load_checkpoint(tmp_path / "c.pt", restore_rng=False) == {"step": 2}
