"""Checkpoint files (issue 13): whatever sits at the path, whatever the disk does, whatever the
file declares, the answer is a CheckpointError naming the file and the cause, and a refused load
or save leaves the user's objects and the previous checkpoint as they were.

Every refusal is paired with the good case, and, where it shows something, with a control that
plain torch does what the issue describes (so the test cannot pass vacuously).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import torchrepro
from torchrepro import CheckpointError, ReproWarning, _io, fingerprint, latest_checkpoint, load_checkpoint
from torchrepro import save_checkpoint as save
from torchrepro._io import TMP_SUFFIX, atomic_write_json
from torchrepro.errors import CheckpointWriteError

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # building modules draws from the torch RNG

SRC = str(Path(torchrepro.__file__).resolve().parents[1])


def run_child(script: str, *args: str) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter that imports this torchrepro; return its last line as JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def assert_clean(error: BaseException) -> None:
    """Never a raw OS or torch traceback underneath."""
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


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


# --------------------------------------------------------------------------- disk full / file-size limit

FILE_SIZE_LIMIT = r"""
import errno, json, os, resource, signal, sys
import torch, torchrepro
from torchrepro import CheckpointError

directory = sys.argv[1]
path = os.path.join(directory, "c.pt")
big = {"weights": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MiB
torchrepro.save_checkpoint(path, step=1)  # the previous checkpoint, before the limit
with open(path, "rb") as f:
    before = f.read()

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, hard))
result = {}
try:  # control: what plain torch.save raises under the same limit
    torch.save(big, os.path.join(directory, "plain.pt"))
except Exception as e:
    result["plain"] = f"{type(e).__name__}: {e}"
os.remove(os.path.join(directory, "plain.pt"))
try:
    torchrepro.save_checkpoint(path, step=2, **big)
    result["error"] = None
except CheckpointError as e:
    result["error"] = str(e)
    result["oserror"] = isinstance(e, OSError) and e.errno == errno.EFBIG
    result["clean"] = e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)
result["files"] = sorted(os.listdir(directory))
with open(path, "rb") as f:
    result["unchanged"] = f.read() == before
result["after_failure"] = torchrepro.load_checkpoint(path, restore_rng=False)
torchrepro.save_checkpoint(path, step=3)  # the good case: a save that fits the limit
result["small"] = torchrepro.load_checkpoint(path, restore_rng=False)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
torchrepro.save_checkpoint(path, step=4, **big)  # and the big one once the limit is raised
values = torchrepro.load_checkpoint(path, restore_rng=False)
result["big"] = [values["step"], values["weights"].numel()]
print(json.dumps(result))
"""


def test_a_write_past_the_file_size_limit_is_a_checkpoint_error_that_keeps_the_previous_file(
    tmp_path: Path,
) -> None:
    result = run_child(FILE_SIZE_LIMIT, str(tmp_path))
    assert result["plain"].startswith("RuntimeError: [enforce fail at inline_container.cc")  # the issue
    path = tmp_path / "c.pt"
    assert result["error"] is not None and result["clean"]
    assert result["error"].startswith(f"Cannot write checkpoint {path}: the file would be larger than")
    assert "(File too large)" in result["error"] and "ulimit -f" in result["error"]
    assert "the previous checkpoint there is intact and no temporary file is left" in result["error"]
    assert result["oserror"]  # still an OSError with errno EFBIG for code that handles those
    assert result["files"] == ["c.pt"] and result["unchanged"] and result["after_failure"] == {"step": 1}
    assert result["small"] == {"step": 3} and result["big"] == [4, 1 << 20]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_file_in_the_way_of_the_directory_is_a_checkpoint_write_error(tmp_path: Path, depth: int) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    path = blocker / "c.pt" if depth == 1 else blocker / "sub" / "c.pt"
    with pytest.raises(CheckpointWriteError) as info:
        save(path, step=1)
    assert str(info.value).startswith(
        f"Cannot write checkpoint {path}: a part of its directory path is a file, not a directory ("
    )
    assert f": {blocker}" in str(info.value) or f": {blocker / 'sub'}" in str(info.value)
    assert isinstance(info.value, OSError) and isinstance(info.value, CheckpointError)
    assert_clean(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    save(tmp_path / "c.pt", step=1)  # the good case
    assert load_checkpoint(tmp_path / "c.pt", restore_rng=False) == {"step": 1}


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


# --------------------------------------------------------------------------- validate before copying


def net(out: int = 2, dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, out)).to(dtype)


def with_extra_layer() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (lambda: net(out=3), r"Cannot restore 'model' \(Sequential\) from .*size mismatch for 2.weight"),
        (with_extra_layer, r"Cannot restore 'model' .*Missing key\(s\) in the checkpoint: '3.weight'"),
        (lambda: net(dtype=torch.float16), r"Restoring 'model' from .*did not reproduce the saved state"),
    ],
    ids=["shape", "keys", "dtype"],
)
def test_a_refused_module_load_leaves_the_module_unchanged(tmp_path: Path, target: Any, message: str) -> None:
    saved = net()
    path = save(tmp_path / "c.pt", model=saved)
    control = target()
    before = fingerprint(control)
    with contextlib.suppress(RuntimeError):  # shapes, keys: raises after copying the rest
        control.load_state_dict(saved.state_dict())  # dtypes: converts
    assert fingerprint(control) != before  # control: plain torch changes the module
    model = target()
    before = fingerprint(model)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path, model=model)
    assert "Nothing was changed" in str(info.value)
    assert fingerprint(model) == before
    good = net()
    load_checkpoint(path, model=good)  # the good case
    assert fingerprint(good) == fingerprint(saved)


def test_verify_false_still_converts_dtypes(tmp_path: Path) -> None:
    """The dtype check belongs to ``verify``: without it a float32 state loads into float16."""
    saved = net()
    path = save(tmp_path / "c.pt", model=saved)
    half = net(dtype=torch.float16)
    load_checkpoint(path, model=half, verify=False, restore_rng=False)
    assert torch.equal(half[0].weight, saved[0].weight.half())


def test_a_later_object_refused_leaves_the_earlier_ones_unchanged(tmp_path: Path) -> None:
    saved = net()
    opt = torch.optim.SGD(saved.parameters(), lr=0.1, momentum=0.9)
    saved(torch.ones(1, 4)).sum().backward()
    opt.step()
    path = save(tmp_path / "c.pt", model=saved, optimizer=opt, gen=torch.Generator().manual_seed(1))

    model = net()
    before = fingerprint(model)
    only_last = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)  # other groups
    with pytest.raises(
        CheckpointError, match=r"'optimizer' \(SGD\) .*parameter groups of \[4\] .*, the optimizer \[2\]"
    ):
        load_checkpoint(path, model=model, optimizer=only_last, gen=torch.Generator().manual_seed(1))
    assert fingerprint(model) == before
    with pytest.raises(CheckpointError, match=r"RNG state .*captured as a torch generator but a numpy"):
        load_checkpoint(path, model=model, gen=np.random.default_rng(0))
    assert fingerprint(model) == before

    good = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the good case
    load_checkpoint(path, model=model, optimizer=good, gen=torch.Generator())
    assert fingerprint(model) == fingerprint(saved)
    assert fingerprint(good.state_dict()) == fingerprint(opt.state_dict())


# --------------------------------------------------------------------------- background fsync

_BG = "torchrepro-fsync"  # the name of the background fsync threads


@contextlib.contextmanager
def fsync_held() -> Any:
    """``os.fsync`` in the background fsync threads waits until the block ends (the main
    thread's fsyncs run as usual); yields the log of the fsyncs that finished there."""
    real, release, log = os.fsync, threading.Event(), []

    def held(fd: int) -> None:
        if threading.current_thread().name == _BG:
            release.wait()
            log.append(stat.S_ISDIR(os.fstat(fd).st_mode))  # True: the directory's fsync
        real(fd)

    os.fsync = held
    try:
        yield log, release
    finally:
        release.set()
        torchrepro.checkpoint.wait_for_checkpoints()
        os.fsync = real


def test_the_file_is_complete_at_its_path_before_its_background_fsync(tmp_path: Path) -> None:
    model = net()
    with fsync_held() as (log, release):
        path = save(tmp_path / "step-1.pt", model=model, step=1)
        assert _io.pending_paths() == [Path(path)] and log == []  # not on disk yet...
        fresh = net(out=2)
        assert load_checkpoint(path, model=fresh) == {"step": 1}  # ...but complete: no wait
        assert fingerprint(fresh) == fingerprint(model)
        assert not list(tmp_path.glob(f"*{TMP_SUFFIX}"))
        release.set()
    assert _io.pending_paths() == [] and log == [False, True]  # the file, then the directory


def test_latest_checkpoint_waits_until_the_newest_file_is_durable(tmp_path: Path) -> None:
    save(tmp_path / "step-1.pt", model=net(), durable="now")
    with fsync_held() as (log, release):
        newest = save(tmp_path / "step-2.pt", model=net())
        threading.Timer(0.2, release.set).start()
        # Neither the older durable file (a resume would silently go back a step) nor the
        # newest before its fsyncs: latest_checkpoint waits for them.
        assert latest_checkpoint(tmp_path) == newest
        assert log == [False, True]


def test_a_save_over_an_existing_file_is_durable_before_it_returns(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    threads: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        threads.append(threading.current_thread().name)
        real(fd)

    os.fsync = record
    try:
        save(path, model=net(), step=1)  # a new file: fsynced in the background
        torchrepro.checkpoint.wait_for_checkpoints()
        assert threads == [_BG, _BG]
        threads.clear()
        save(path, model=net(), step=2)  # replaces a checkpoint: never less durable than the old one
        assert threads == ["MainThread", "MainThread"] and _io.pending_paths() == []
        threads.clear()
        save(tmp_path / "other.pt", model=net(), durable="now")
        assert threads == ["MainThread", "MainThread"] and _io.pending_paths() == []
    finally:
        os.fsync = real
    assert load_checkpoint(path, model=net()) == {"step": 2}


@pytest.mark.parametrize("reported_by", ["save", "wait", "latest", "load"])
def test_a_failed_background_fsync_is_raised_once_and_leaves_no_file(
    tmp_path: Path, reported_by: str
) -> None:
    earlier = save(tmp_path / "step-1.pt", model=net(), step=1, durable="now")
    real = os.fsync

    def full_disk(fd: int) -> None:
        if threading.current_thread().name == _BG:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    os.fsync = full_disk
    try:
        failed = save(tmp_path / "step-2.pt", model=net(), step=2)
        while _io.pending_paths():  # the failure is known once its thread is done
            threading.Event().wait(0.01)
        message = rf"Cannot write checkpoint {re.escape(failed)} to disk: .*fsync.*the disk is full"
        with pytest.raises(CheckpointWriteError, match=message) as info:
            if reported_by == "save":
                save(tmp_path / "step-3.pt", model=net(), durable="now")
            elif reported_by == "wait":
                torchrepro.checkpoint.wait_for_checkpoints()
            elif reported_by == "latest":
                latest_checkpoint(tmp_path)
            else:
                load_checkpoint(earlier, model=net())
    finally:
        os.fsync = real
    assert info.value.errno == errno.ENOSPC and "earlier checkpoints are intact" in str(info.value)
    assert_clean(info.value)
    assert not Path(failed).exists() and not list(tmp_path.glob(f"*{TMP_SUFFIX}"))
    torchrepro.checkpoint.wait_for_checkpoints()  # raised once, not again
    assert latest_checkpoint(tmp_path) == earlier
    assert load_checkpoint(earlier, model=net()) == {"step": 1}


def test_durable_is_an_option_not_an_object_name(tmp_path: Path) -> None:
    for bad in ("later", 1, True):
        with pytest.raises(ValueError, match=r"durable=.*'background' \(default\) or 'now'.*another name"):
            save(tmp_path / "c.pt", model=net(), durable=bad)
    assert not list(tmp_path.iterdir())


def test_a_forked_child_does_not_wait_on_its_parents_pending_fsync(tmp_path: Path) -> None:
    with fsync_held() as (log, release):
        path = save(tmp_path / "c.pt", model=net())
        assert _io.pending_paths() == [Path(path)]  # what a child could inherit
        pid = os.fork()
        if pid == 0:  # the child: nothing pending, nothing to wait for (the parent's fsync is held)
            if _io.pending_paths() != [] or os.path.getsize(path) == 0:
                os._exit(1)
            torchrepro.checkpoint.wait_for_checkpoints()  # returns: the held fsync is not its own
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _io.pending_paths() == [Path(path)] and log == []  # the parent's is still its own
        release.set()
        torchrepro.checkpoint.wait_for_checkpoints()
        assert log == [False, True]


_CHILD_SAVE = """
import json, os, signal, sys, threading, time
import torch, torchrepro
from torchrepro import _io
mode, path = sys.argv[1], sys.argv[2]
real, log = os.fsync, []
def fsync(fd):
    if threading.current_thread().name == "torchrepro-fsync":
        if mode == "fail":
            raise OSError(28, "No space left on device")
        threading.Event().wait(3600 if mode == "kill" else 0.3)  # still pending at the kill / exit
        log.append(fd)
        if len(log) == 2:
            open(path + ".synced", "w").close()
    real(fd)
os.fsync = fsync
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
torchrepro.save_checkpoint(path, model=model, step=7)
pending = [str(p) for p in _io.pending_paths()]
print(json.dumps({"pending": pending, "fp": torchrepro.fingerprint(model)}), flush=True)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "os_exit":
    os._exit(0)
"""


def _child_save(path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", _CHILD_SAVE, mode, str(path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def test_a_process_killed_right_after_save_returns_leaves_the_complete_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "step-7.pt"
    proc = _child_save(path, "kill")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pending"] == [str(path)]  # killed before its background fsync: not yet durable
    assert not Path(f"{path}.synced").exists()
    model = torch.nn.Linear(64, 64)
    assert latest_checkpoint(tmp_path) == str(path)  # complete and verified
    assert load_checkpoint(path, model=model, restore_rng=False) == {"step": 7}
    assert fingerprint(model) == out["fp"]
    assert not list(tmp_path.glob(f"*{TMP_SUFFIX}"))


def test_interpreter_exit_waits_for_background_fsyncs_and_reports_failures(tmp_path: Path) -> None:
    waited = _child_save(tmp_path / "a.pt", "exit")
    assert waited.returncode == 0, waited.stderr
    assert json.loads(waited.stdout.strip().splitlines()[-1])["pending"] == [str(tmp_path / "a.pt")]
    assert (tmp_path / "a.pt.synced").exists()  # exit waited for both fsyncs
    control = _child_save(tmp_path / "b.pt", "os_exit")  # os._exit skips atexit: nothing waits
    assert control.returncode == 0 and not (tmp_path / "b.pt.synced").exists()

    failed = _child_save(tmp_path / "c.pt", "fail")
    assert f"torchrepro: ERROR: {tmp_path / 'c.pt'} could not be written to disk durably" in failed.stderr
    assert "No space left on device" in failed.stderr and "Traceback" not in failed.stderr
    assert not (tmp_path / "c.pt").exists() and not list(tmp_path.glob(f"*{TMP_SUFFIX}"))
