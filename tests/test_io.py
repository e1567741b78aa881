"""Atomic writes leave the old file or the new one, never a torn one or a stray temp file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchrepro._io import TMP_SUFFIX, atomic_open, atomic_torch_save, atomic_write_json


def test_json_round_trip_and_no_temp_left(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "a.json"
    atomic_write_json(p, {"b": 1, "a": [1, 2]})
    assert json.loads(p.read_text()) == {"a": [1, 2], "b": 1}
    assert [x.name for x in p.parent.iterdir()] == ["a.json"]


def test_failure_mid_write_keeps_old_file(tmp_path: Path) -> None:
    p = tmp_path / "a.bin"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_open(p) as f:
        f.write(b"new but partial")
        raise RuntimeError("crash")
    assert p.read_bytes() == b"old"
    assert not list(tmp_path.glob(f"*{TMP_SUFFIX}"))


def test_torch_save_loads_with_weights_only(tmp_path: Path) -> None:
    p = tmp_path / "t.pt"
    atomic_torch_save(p, {"w": torch.arange(3), "step": 4})
    loaded = torch.load(p, weights_only=True)
    assert torch.equal(loaded["w"], torch.arange(3)) and loaded["step"] == 4
