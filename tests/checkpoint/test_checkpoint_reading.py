"""Reading checkpoint files (checkpoint.reading, issue 13): whatever sits at the path and whatever
the file declares, the answer is a CheckpointError naming the file and the cause, and a refused
load leaves the user's objects as they were; ``latest_checkpoint`` orders by the save clock and
skips, with a warning, what it cannot use; a load racing saves of the same path reads one file.

Every refusal is paired with the good case, and, where it shows something, with a control that
plain torch does what the issue describes (so the test cannot pass vacuously).
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import assert_clean, damage, run_child
from torch import nn

from torchrepro import CheckpointError, ReproWarning, latest_checkpoint, load_checkpoint
from torchrepro import save_checkpoint as save
from torchrepro._io import TMP_SUFFIX

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # building modules draws from the torch RNG


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("truncated", "truncated"),
        ("empty", "empty"),
        ("garbage", "not a torch zip file"),
        ("flipped-bit", "did not reproduce the saved state"),
        ("plain-torch-save", "not a torchrepro checkpoint"),
        ("pickled-object", "pickled Python objects"),
    ],
)
def test_damaged_files_are_checkpoint_errors_naming_the_file(tmp_path: Path, kind: str, message: str) -> None:
    path = tmp_path / "c.pt"
    save(path, model=nn.Linear(64, 64))  # its weight is the largest tensor in the file
    damage(kind, path)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path, model=nn.Linear(64, 64), restore_rng=False)
    assert str(path) in str(info.value)
    error = info.value  # never a raw unpickling traceback underneath
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_latest_uses_the_save_clock_not_mtime(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        save(tmp_path / f"zz-{4 - step}.pt", step=step)  # names sort opposite to save order
    os.utime(tmp_path / "zz-3.pt", (2e9, 2e9))  # the oldest save gets the newest mtime
    (tmp_path / "notes.txt").write_text("not a checkpoint")  # ignored silently
    (tmp_path / f".zz-0.pt.abc{TMP_SUFFIX}").write_bytes(b"PK\x03\x04 write in progress")  # ignored
    assert latest_checkpoint(tmp_path) == str(tmp_path / "zz-1.pt")


@pytest.mark.parametrize("kind", ["truncated", "flipped-bit", "garbage"])
def test_latest_skips_damaged_files_with_a_warning(tmp_path: Path, kind: str) -> None:
    save(tmp_path / "step-1.pt", model=nn.Linear(64, 64), step=1)
    save(tmp_path / "step-2.pt", model=nn.Linear(64, 64), step=2)
    damage(kind, tmp_path / "step-2.pt")
    with pytest.warns(ReproWarning, match=r"Skipping checkpoint: .*step-2\.pt"):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "step-1.pt")


def test_latest_skips_incomplete_rank_sets(tmp_path: Path) -> None:
    save(tmp_path / "step-1.pt", step=1)
    path = tmp_path / "step-2.pt"
    save(path, step=2)
    payload = torch.load(path, weights_only=True)
    payload["meta"]["world_size"] = 2  # rank 1's file never got written
    torch.save(payload, path)
    with pytest.warns(
        ReproWarning, match=r"step-2\.pt is incomplete: rank 1's file step-2\.pt\.rank1 is missing"
    ):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "step-1.pt")


def test_latest_in_a_directory_not_made_yet_is_none_and_in_a_file_an_error(tmp_path: Path) -> None:
    """A first run resumes from nothing: ``latest_checkpoint("ckpt")`` before the first save (the
    resume example of docs/checkpoints.md) used to raise; a path that is a file still does."""
    assert latest_checkpoint(tmp_path / "not-yet") is None
    assert not (tmp_path / "not-yet").exists()  # asking creates nothing
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointError, match=r"a-file is not a directory"):
        latest_checkpoint(tmp_path / "a-file")


# -- a load racing saves of the same path ----------------------------------------------------------


def _keep_saving(path: str, stop: Any) -> None:
    model = nn.Linear(64, 64)
    tag = 0
    while not stop.is_set():
        tag += 1
        with torch.no_grad():
            model.weight.fill_(float(tag))
            model.bias.fill_(float(tag))
        save(path, model=model, tag=tag)


@pytest.mark.parametrize("verify", [False, True])
def test_a_load_racing_saves_reads_one_file(tmp_path: Path, verify: bool) -> None:
    import multiprocessing
    import time

    path = str(tmp_path / "last.pt")
    save(path, model=nn.Linear(64, 64), tag=0)
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    writer = ctx.Process(target=_keep_saving, args=(path, stop))
    writer.start()
    mixed, loads = [], 0
    try:
        deadline = time.monotonic() + 3.0
        model = nn.Linear(64, 64)
        while time.monotonic() < deadline:
            tag = load_checkpoint(path, model=model, verify=verify, restore_rng=False)["tag"]
            loads += 1
            if tag and not (bool((model.weight == tag).all()) and bool((model.bias == tag).all())):
                mixed.append(tag)
    finally:
        stop.set()
        writer.join(timeout=30)
    assert loads > 20 and mixed == [], f"{len(mixed)} of {loads} loads mixed two saves"


# --------------------------------------------------------------------------- not a readable file


def _put_in_the_way(kind: str, path: Path) -> str:
    """Put something that is not a readable checkpoint file at ``path``; return the words that
    name it in the error."""
    if kind == "directory":
        path.mkdir()
        return "is a directory"
    if kind == "symlink-loop":
        path.symlink_to(path.name)  # x.pt -> x.pt
        return "symbolic link loop"
    if kind == "dangling-symlink":
        path.symlink_to("gone.pt")
        return "symbolic link to a file that does not exist"
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would wait for a writer forever
        return r"named pipe \(FIFO\)"
    raise AssertionError(kind)


IN_THE_WAY = ["directory", "symlink-loop", "dangling-symlink", "fifo"]


@pytest.mark.parametrize("kind", IN_THE_WAY)
def test_a_path_that_is_not_a_checkpoint_file_is_a_checkpoint_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.pt"
    words = _put_in_the_way(kind, path)
    if kind in ("directory", "symlink-loop"):  # control: what a plain open (and torch.load) raises
        with pytest.raises(OSError):
            open(path, "rb").close()
    with pytest.raises(CheckpointError, match=rf"^Checkpoint {re.escape(str(path))} .*{words}") as info:
        load_checkpoint(path, model=nn.Linear(2, 2))
    assert_clean(info.value)
    # the good case: a checkpoint file at that name loads
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink()
    save(path, model=nn.Linear(2, 2), step=3)
    assert load_checkpoint(path, model=nn.Linear(2, 2)) == {"step": 3}


@pytest.mark.parametrize("kind", IN_THE_WAY)
def test_latest_skips_what_is_not_a_readable_checkpoint_with_a_warning(tmp_path: Path, kind: str) -> None:
    save(tmp_path / "step-1.pt", step=1)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step-1.pt")  # the good case, alone
    words = _put_in_the_way(kind, tmp_path / "step-2.pt")
    where = re.escape(str(tmp_path / "step-2.pt"))
    with pytest.warns(ReproWarning, match=rf"Skipping checkpoint: Checkpoint {where} .*{words}"):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "step-1.pt")


UNREADABLE = r"""
import ctypes, json, os, sys, warnings

if os.geteuid() == 0:
    # Root reads a file whatever its mode. Drop the two capabilities that let it (for this thread,
    # before torch starts any other), so chmod 000 means for root what it means for anyone.
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(header), data) == 0, ctypes.get_errno()
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        data[0].effective &= ~(1 << cap)
        data[0].permitted &= ~(1 << cap)
    assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()

import torchrepro
from torchrepro import CheckpointError

directory, unreadable, locked = sys.argv[1:4]
result = {}
try:  # control: the file really is unreadable for this process
    open(unreadable, "rb").close()
    result["open"] = "readable"
except PermissionError as e:
    result["open"] = type(e).__name__
try:
    torchrepro.load_checkpoint(unreadable, restore_rng=False)
    result["load"] = None
except CheckpointError as e:
    result["load"] = str(e)
    result["clean"] = e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result["latest"] = torchrepro.latest_checkpoint(directory)
result["warnings"] = [str(w.message) for w in caught]
result["values"] = torchrepro.load_checkpoint(result["latest"], restore_rng=False)
try:  # a directory that cannot be listed
    torchrepro.latest_checkpoint(locked)
    result["locked"] = None
except CheckpointError as e:
    result["locked"] = str(e)
print(json.dumps(result))
"""


def test_an_unreadable_file_is_a_checkpoint_error_and_latest_skips_it(tmp_path: Path) -> None:
    save(tmp_path / "step-1.pt", step=1)
    unreadable = tmp_path / "step-2.pt"
    save(unreadable, step=2)
    locked = tmp_path / "locked"
    locked.mkdir()
    save(locked / "step-1.pt", step=1)
    unreadable.chmod(0)
    locked.chmod(0)
    try:
        result = run_child(UNREADABLE, str(tmp_path), str(unreadable), str(locked))
    finally:
        unreadable.chmod(0o644)
        locked.chmod(0o755)
    assert result["open"] == "PermissionError"  # the file really was unreadable (root included)
    assert result["load"] is not None and result["clean"]
    assert result["load"].startswith(f"Checkpoint {unreadable} cannot be read: permission denied")
    assert "chmod u+r" in result["load"]
    # latest_checkpoint skips it with a warning instead of raising, and the older one loads
    assert result["latest"] == str(tmp_path / "step-1.pt") and result["values"] == {"step": 1}
    assert result["warnings"] == [f"Skipping checkpoint: {result['load']}"]
    assert result["locked"] == (
        f"Checkpoint directory {locked} cannot be listed: permission denied (Permission denied). "
        "Make it readable for this user (chmod u+r) or load it as its owner."
    )
    # the good case: readable again, it is the latest and loads
    assert latest_checkpoint(tmp_path) == str(unreadable)
    assert load_checkpoint(unreadable, restore_rng=False) == {"step": 2}


# --------------------------------------------------------------------------- declared sizes

BOMB_BYTES = 80 << 20  # a string this long unpacked, from a file of ~100 KiB


def _deflate_pickle(path: Path, out: Path) -> None:
    """Rewrite the checkpoint at ``path`` with its pickle deflated (torch.load inflates it)."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            member = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            pickle = info.filename.endswith("data.pkl")
            member.compress_type = zipfile.ZIP_DEFLATED if pickle else zipfile.ZIP_STORED
            dst.writestr(member, src.read(info))


BOMB = r"""
import json, sys
import torchrepro
from torchrepro import CheckpointError


def peak_growth(step):  # how far the peak resident memory rises while step() runs
    def peak():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak becomes the current resident size
    start = peak()
    value = step()
    return value, peak() - start


small, bomb, raised = sys.argv[1], sys.argv[2], int(sys.argv[3])
result = {"small": torchrepro.load_checkpoint(small, restore_rng=False)}  # warms up every import


def refused():
    try:
        torchrepro.load_checkpoint(bomb, restore_rng=False)
    except CheckpointError as e:
        return str(e)


result["refused"], result["grew_when_refused"] = peak_growth(refused)
values, result["grew_when_loaded"] = peak_growth(
    lambda: torchrepro.load_checkpoint(bomb, restore_rng=False, max_expanded_bytes=raised)
)
result["length"] = len(values["pad"])
print(json.dumps(result))
"""


def test_an_archive_that_expands_far_beyond_its_size_is_refused_before_it_is_unpacked(tmp_path: Path) -> None:
    save(tmp_path / "big.pt", pad="x" * BOMB_BYTES)
    bomb = tmp_path / "bomb.pt"
    _deflate_pickle(tmp_path / "big.pt", bomb)
    (tmp_path / "big.pt").unlink()
    size = bomb.stat().st_size
    assert size < 1 << 20  # control: a small file that torch.load would inflate to 80 MiB
    save(tmp_path / "small.pt", step=1)
    result = run_child(BOMB, str(tmp_path / "small.pt"), str(bomb), str(BOMB_BYTES + (1 << 20)))
    assert result["small"] == {"step": 1}  # the good case loads with the default limit
    refused = result["refused"]
    assert refused is not None and refused.startswith(f"Checkpoint {bomb} was refused before unpacking it")
    assert f"limit of {2 * size + (64 << 20):,} bytes (the default" in refused
    assert "pass max_expanded_bytes=" in refused and "to load_checkpoint or latest_checkpoint" in refused
    # refused before anything was inflated; with the limit raised it is inflated (and loads)
    assert result["grew_when_refused"] < 16 << 20
    assert result["length"] == BOMB_BYTES and result["grew_when_loaded"] > BOMB_BYTES
    with pytest.warns(ReproWarning, match=rf"Skipping checkpoint: Checkpoint {bomb} was refused"):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "small.pt")


def test_a_tensor_view_declaring_more_than_it_stores_is_refused_before_it_is_copied(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(path, mask=torch.zeros(1).expand(1000))  # the good case: a small expanded view
    assert torch.equal(load_checkpoint(path, restore_rng=False)["mask"], torch.zeros(1000))
    payload = torch.load(path, weights_only=True)
    payload["objects"]["mask"]["state"] = torch.zeros(1).expand(1 << 36)  # 256 GiB from 4 bytes
    torch.save(payload, path)
    assert path.stat().st_size < 1 << 20
    assert torch.load(path, weights_only=True)["objects"]["mask"]["state"].shape == (1 << 36,)  # control
    with zipfile.ZipFile(path) as archive:
        declared = sum(i.file_size for i in archive.infolist())
    with pytest.raises(CheckpointError, match=r"refused before checksumming it: .*tensor views") as info:
        load_checkpoint(path, restore_rng=False)  # a checksum would copy 256 GiB
    assert f"pass max_expanded_bytes={declared + (1 << 38)} (or more)" in str(info.value)
    assert_clean(info.value)


def test_max_expanded_bytes_is_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save(path, table=torch.arange(10_000.0))  # 40 kB of tensor data
    with pytest.raises(CheckpointError, match=r"limit of 1,000 bytes \(max_expanded_bytes\)"):
        load_checkpoint(path, restore_rng=False, max_expanded_bytes=1000)
    with pytest.warns(ReproWarning, match=r"Skipping checkpoint: .*max_expanded_bytes"):
        assert latest_checkpoint(tmp_path, max_expanded_bytes=1000) is None
    values = load_checkpoint(path, restore_rng=False, max_expanded_bytes=1 << 20)  # the good case
    assert torch.equal(values["table"], torch.arange(10_000.0))
    assert latest_checkpoint(tmp_path, max_expanded_bytes=1 << 20) == str(path)
    with pytest.raises(TypeError, match="max_expanded_bytes must be an int"):
        load_checkpoint(path, max_expanded_bytes=1e9)
    with pytest.raises(ValueError, match="max_expanded_bytes must be >= 0"):
        latest_checkpoint(tmp_path, max_expanded_bytes=-1)
