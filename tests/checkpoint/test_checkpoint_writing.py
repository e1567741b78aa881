"""Writing (checkpoint.writing): a failed write is a CheckpointWriteError naming the file and the
cause and keeps the previous checkpoint; files get the mode the umask gives; a new file is
complete at its path when the save returns and fsynced in the background, waited for by the next
save, ``latest_checkpoint`` and exit, and a failed background fsync is raised once.

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
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import assert_clean, net, run_child

import torchrepro
from helpers import user_env
from torchrepro import CheckpointError, _io, fingerprint, latest_checkpoint, load_checkpoint
from torchrepro import save_checkpoint as save
from torchrepro._io import TMP_SUFFIX, atomic_write_json
from torchrepro.errors import CheckpointWriteError

pytestmark = pytest.mark.usefixtures("rng_changes_ok")  # building modules draws from the torch RNG


def test_failed_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.pt"
    save(path, step=1)

    def crash(obj: Any, f: Any) -> None:
        f.write(b"PK\x03\x04 partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save(path, step=2)
    monkeypatch.undo()
    assert load_checkpoint(path, restore_rng=False) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


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
    return subprocess.run(
        [sys.executable, "-c", _CHILD_SAVE, mode, str(path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=user_env(),
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
