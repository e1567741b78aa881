"""The checkpoint format (checkpoint.format): only what ``torch.load(weights_only=True)`` loads is
saved, stored states carry checksums, the environment record is compared on load, format versions
are checked, and a damaged save clock cannot reorder checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import assert_clean, flip_tensor_byte
from torch import nn

from torchrepro import CheckpointError, ReproWarning, latest_checkpoint, load_checkpoint
from torchrepro import save_checkpoint as save

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # building modules draws from the torch RNG


class Unsafe:
    def state_dict(self) -> dict[str, Any]:
        return {"ok": 1, "nested": {"fn": [1, print]}}

    def load_state_dict(self, d: dict[str, Any]) -> None:  # pragma: no cover - never loaded
        pass


def test_save_refuses_what_weights_only_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"'thing': its state at \['nested'\]\['fn'\]\[1\] is an arbitrary"
    ):
        save(tmp_path / "c.pt", thing=Unsafe())
    with pytest.raises(TypeError, match=r"Cannot checkpoint 'obj' of type builtins.object"):
        save(tmp_path / "c.pt", obj=object())
    with pytest.raises(TypeError, match=r"plain torch DataLoader .* torchrepro.SeededLoader"):
        save(tmp_path / "c.pt", loader=torch.utils.data.DataLoader(list(range(4))))
    with pytest.raises(ValueError, match="at least one object"):
        save(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="temporary or per-rank"):
        save(tmp_path / "c.pt.rank1", x=1)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temp file


def test_flipped_bit_in_a_plain_value_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(path, table=torch.arange(10000.0))
    flip_tensor_byte(path)
    with pytest.raises(CheckpointError, match=r"stored state of 'table' does not match its checksum"):
        load_checkpoint(path, restore_rng=False)


def test_other_environment_warns_with_the_differences(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(path, x=1)
    payload = torch.load(path, weights_only=True)
    payload["env"]["torch"] = "1.13.1"
    payload["env"]["determinism"]["cudnn.benchmark"] = True
    torch.save(payload, path)
    with pytest.warns(
        ReproWarning, match=r"torch: saved '1.13.1', now .*determinism.cudnn.benchmark: saved True"
    ):
        assert load_checkpoint(path, restore_rng=False) == {"x": 1}


def test_newer_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(path, x=1)
    payload = torch.load(path, weights_only=True)
    payload["torchrepro_checkpoint"] = 99
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match="format version 99"):
        load_checkpoint(path)


# --------------------------------------------------------------------------- the save clock


def _flip_clock_bit(path: Path) -> None:
    """Flip one bit of the pickled ``saved_at_ns`` so that the clock grows, on any date.

    The bit is the lowest 0 bit from bit 44 up (2**44 ns is about 5 hours): setting a 0 bit makes the
    value larger whatever the date, where flipping a fixed bit makes it smaller while that bit is 1.
    """
    saved_at = torch.load(path, weights_only=True)["meta"]["saved_at_ns"]
    bit = next(b for b in range(44, 62) if not saved_at >> b & 1)
    data = bytearray(path.read_bytes())
    needle = b"\x8a\x08" + saved_at.to_bytes(8, "little", signed=True)  # pickle LONG1, 8 bytes
    assert data.count(needle) == 1
    data[data.index(needle) + 2 + bit // 8] ^= 1 << bit % 8
    path.write_bytes(bytes(data))
    assert torch.load(path, weights_only=True)["meta"]["saved_at_ns"] == saved_at | 1 << bit


def test_a_flipped_bit_in_the_save_clock_does_not_reorder_checkpoints(tmp_path: Path) -> None:
    older, newer = tmp_path / "step-1.pt", tmp_path / "step-2.pt"
    save(older, step=1)
    save(newer, step=2)
    assert latest_checkpoint(tmp_path) == str(newer)  # the good case
    _flip_clock_bit(older)
    clocks = [torch.load(p, weights_only=True)["meta"]["saved_at_ns"] for p in (older, newer)]
    assert clocks[0] > clocks[1]  # control: by its clock alone, the older file is now the latest
    with pytest.warns(
        ReproWarning, match=rf"Skipping checkpoint: Checkpoint {older} is corrupt: its save clock"
    ):
        assert latest_checkpoint(tmp_path) == str(newer)
    with pytest.raises(CheckpointError, match=r"save clock .* does not match its checksum") as info:
        load_checkpoint(older, restore_rng=False)
    assert_clean(info.value)
    assert load_checkpoint(newer, restore_rng=False) == {"step": 2}


def test_format_1_files_without_a_clock_checksum_still_load(tmp_path: Path) -> None:
    old = tmp_path / "step-1.pt"
    save(old, model=nn.Linear(2, 2), step=1)
    payload = torch.load(old, weights_only=True)
    assert payload["torchrepro_checkpoint"] == 2 and "clock_digest" in payload["meta"]
    payload["torchrepro_checkpoint"] = 1  # what the previous torchrepro wrote
    del payload["meta"]["clock_digest"]
    torch.save(payload, old)
    save(tmp_path / "step-2.pt", step=2)
    assert load_checkpoint(old, model=nn.Linear(2, 2)) == {"step": 1}
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step-2.pt")
    payload["torchrepro_checkpoint"] = 2  # but a version 2 file must have it
    torch.save(payload, old)
    with pytest.raises(CheckpointError, match=r"malformed: 'meta' has no save clock checksum"):
        load_checkpoint(old, model=nn.Linear(2, 2))
