"""Sharded checkpoints (``checkpoint.dcp``), in this process on a gloo group of one: FSDP2 modules
and their optimizers go through DCP into ``<path>.dcp``, load back bit for bit, and a damaged or
hostile directory is refused with a ``CheckpointError`` before anything runs from it. The
reshard across world sizes runs in real processes: tests/invariant/test_fsdp.py."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import torchrepro
from helpers import gloo_group_of_one
from torchrepro.errors import CheckpointError, ReproWarning


@pytest.fixture
def group_of_one(tmp_path: Path, rng_changes_ok: None) -> Iterator[None]:
    with gloo_group_of_one(tmp_path / "store"):
        yield


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    fully_shard(net[0])
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    return net, opt


def _whole(net: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().full_tensor() for p in net.parameters()]
    out += [
        v.full_tensor() if hasattr(v, "full_tensor") else v
        for p in net.parameters()
        for v in opt.state[p].values()
    ]
    return out


def test_round_trip_through_dcp_is_exact_and_the_file_loads_weights_only(
    group_of_one: None, tmp_path: Path
) -> None:
    net, opt = _trained(0)
    path = tmp_path / "step-1.pt"
    torchrepro.save_checkpoint(path, model=net, optimizer=opt, step=1)
    assert (tmp_path / "step-1.pt.dcp" / ".metadata").is_file()
    payload = torch.load(path, weights_only=True)
    assert payload["objects"]["model"]["sharded"] is True
    other, other_opt = _trained(1)
    assert not all(torch.equal(a, b) for a, b in zip(_whole(net, opt), _whole(other, other_opt), strict=True))
    assert torchrepro.load_checkpoint(path, model=other, optimizer=other_opt) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(_whole(net, opt), _whole(other, other_opt), strict=True))
    assert torchrepro.latest_checkpoint(tmp_path) == str(path)


def test_saving_again_replaces_the_directory_whole(group_of_one: None, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    net, opt = _trained(0)
    torchrepro.save_checkpoint(path, model=net, optimizer=opt)
    net2, opt2 = _trained(1)
    torchrepro.save_checkpoint(path, model=net2, optimizer=opt2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "store") == ["ckpt.pt", "ckpt.pt.dcp"]
    fresh, fresh_opt = _trained(2)
    torchrepro.load_checkpoint(path, model=fresh, optimizer=fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(_whole(net2, opt2), _whole(fresh, fresh_opt), strict=True))


def test_a_flipped_byte_in_the_shards_is_named_as_corrupt(group_of_one: None, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    net, opt = _trained(0)
    torchrepro.save_checkpoint(path, model=net, optimizer=opt)
    (data,) = (tmp_path / "ckpt.pt.dcp").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    # the first byte of the first tensor's values: each DCP item is a torch.save zip whose record
    # data/0 holds the values after its local header, an "FB" extra field padded with "Z"s
    header = raw.index(b"data/0")
    at = raw.index(b"FB", header) + 4
    while raw[at] == ord("Z"):
        at += 1
    raw[at] ^= 0x40
    data.write_bytes(bytes(raw))
    fresh, fresh_opt = _trained(1)
    with pytest.raises(CheckpointError, match=r"corrupt|Cannot load the sharded state"):
        torchrepro.load_checkpoint(path, model=fresh, optimizer=fresh_opt)


def test_a_missing_directory_is_named(group_of_one: None, tmp_path: Path) -> None:
    import shutil

    path = tmp_path / "ckpt.pt"
    net, opt = _trained(0)
    torchrepro.save_checkpoint(path, model=net, optimizer=opt)
    shutil.rmtree(tmp_path / "ckpt.pt.dcp")
    with pytest.raises(CheckpointError, match=r"ckpt\.pt\.dcp, which is missing or incomplete"):
        torchrepro.load_checkpoint(path, model=net, optimizer=opt)
    with pytest.warns(ReproWarning, match=r"incomplete: the sharded state of 'model' in ckpt\.pt\.dcp"):
        assert torchrepro.latest_checkpoint(tmp_path) is None  # skipped, never handed out


class _Payload:
    def __reduce__(self):  # what a hostile metadata file would run on a plain pickle.load
        return (os.system, (f"touch {os.environ['TORCHREPRO_TEST_MARKER']}",))


def test_hostile_metadata_is_refused_without_running_it(
    group_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.pt"
    net, opt = _trained(0)
    torchrepro.save_checkpoint(path, model=net, optimizer=opt)
    marker = tmp_path / "ran"
    monkeypatch.setenv("TORCHREPRO_TEST_MARKER", str(marker))
    (tmp_path / "ckpt.pt.dcp" / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError, match=r"posix\.system|os\.system"):
        torchrepro.load_checkpoint(path, model=net, optimizer=opt)
    assert not marker.exists()


def test_an_optimizer_without_its_module_is_refused(group_of_one: None, tmp_path: Path) -> None:
    _, opt = _trained(0)
    with pytest.raises(CheckpointError, match=r"pass the FSDP2 module too"):
        torchrepro.save_checkpoint(tmp_path / "ckpt.pt", optimizer=opt)
