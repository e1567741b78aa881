"""Write isolation's parts without torch: the overlay the supervisor enters (as root, and as a user
that is not), the write watch, and which paths count as written by two runs at once."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import SRC, user_env
from torchrepro._child.overlay import Overlay, _unescape
from torchrepro._child.writes import read_writes
from torchrepro.isolation import Layers, describe_shared, probe, shared_writes
from torchrepro.results import Isolation
from torchrepro.runrecord import WRITES_FILE

SHELL = "echo new > model.pt; echo ev > records/ev; mkdir made; rm old.txt; cat model.pt"


def _supervise(
    cwd: Path,
    overlay: Overlay,
    python: str = sys.executable,
    user: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> str:
    """Run ``SHELL`` under the supervisor in ``overlay`` (``env``: ``user_env()``); return its output."""
    code = (
        "import os, subprocess, sys; sys.exit(subprocess.call([sys.executable, '-m', "
        f"'torchrepro._child.supervisor', str(os.getpid()), '--overlay', {overlay.to_arg()!r}, "
        f"'--', 'sh', '-c', {SHELL!r}]))"
    )
    proc = subprocess.run(
        [*user, python, "-c", code],
        cwd=cwd,
        env=user_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _tree(root: Path) -> tuple[Path, Overlay]:
    cwd = root / "cwd"
    (cwd / "records").mkdir(parents=True)
    (cwd / "model.pt").write_text("user's\n")
    (cwd / "old.txt").write_text("old\n")
    for sub in ("upper", "work"):
        (root / "layer" / sub).mkdir(parents=True)
    overlay = Overlay(root=str(cwd), layer=str(root / "layer"), keep=(str(cwd / "records"),))
    return cwd, overlay


def _assert_isolated(cwd: Path, overlay: Overlay, out: str) -> None:
    assert out == "new\n"  # the run saw its own write
    assert (cwd / "model.pt").read_text() == "user's\n"  # the user's file is untouched
    assert (cwd / "old.txt").exists() and not (cwd / "made").exists()
    assert (cwd / "records" / "ev").read_text() == "ev\n"  # a kept directory is the real one
    upper = Path(overlay.upper)
    assert (upper / "model.pt").read_text() == "new\n" and (upper / "made").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount namespace without a user namespace needs root")
def test_the_supervisor_overlays_the_directory_as_root(tmp_path: Path) -> None:
    cwd, overlay = _tree(tmp_path)
    _assert_isolated(cwd, overlay, _supervise(cwd, overlay))


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"),
    reason="needs root to become an unprivileged user (setpriv) and a python that user can run",
)
def test_the_supervisor_overlays_the_directory_in_a_user_namespace_for_a_user_that_is_not_root() -> None:
    # The supervisor imports only the standard library, so the system python runs it as nobody,
    # from a copy of the package that nobody can read: the checkout may sit where only root may
    # enter (a clone into a fresh `mktemp -d` directory, mode 0700).
    root = Path(tempfile.mkdtemp(prefix="torchrepro-userns-"))
    try:
        cwd, overlay = _tree(root)
        staged = root / "site"
        shutil.copytree(
            Path(SRC) / "torchrepro", staged / "torchrepro", ignore=shutil.ignore_patterns("__pycache__")
        )
        subprocess.run(["chown", "-R", "65534:65534", str(root)], check=True)
        nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
        env = {**user_env(), "PYTHONPATH": str(staged), "PYTHONDONTWRITEBYTECODE": "1"}
        out = _supervise(cwd, overlay, python="/usr/bin/python3", user=nobody, env=env)
        _assert_isolated(cwd, overlay, out)
        assert (Path(overlay.upper) / "model.pt").stat().st_uid == 65534  # the user's own uid, not root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_layers_collect_a_runs_writes_into_its_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd, _ = _tree(tmp_path)
    check_dir = cwd / ".torchrepro" / "checks" / "c"
    (check_dir / "run0").mkdir(parents=True)
    layers = Layers.create(check_dir, str(cwd))
    assert layers is not None and not layers.base.startswith(str(cwd))
    if os.geteuid() == 0:
        assert probe(layers) == (False, None)
    overlay = layers.overlay(check_dir / "run0")
    Path(overlay.upper, "sub").mkdir()
    Path(overlay.upper, "sub", "ckpt.pt").write_text("x")
    if os.geteuid() == 0:  # overlayfs's whiteout: a character device 0/0 (mknod needs root)
        os.mknod(Path(overlay.upper, "old.txt"), 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    layers.collect(check_dir / "run0")
    assert (check_dir / "run0" / "files" / "sub" / "ckpt.pt").read_text() == "x"
    if os.geteuid() == 0:  # a whiteout (the run deleted old.txt) is listed, not kept
        assert (check_dir / "run0" / "files.deleted").read_text() == "old.txt\n"
        assert not (check_dir / "run0" / "files" / "old.txt").exists()
    layers.close()
    assert not os.path.exists(layers.base)


def test_overlay_arguments_and_mountinfo_escapes() -> None:
    overlay = Overlay(root="/a b,c", layer="/l:1", keep=("/a b,c/k",))
    assert Overlay.from_arg(overlay.to_arg()) == overlay
    with pytest.raises(ValueError, match="not an overlay"):
        Overlay.from_arg('{"root": 1}')
    assert _unescape(r"/mnt/my\040data\134x") == "/mnt/my data\\x"


def test_the_watch_notes_every_kind_of_write_once(tmp_path: Path) -> None:
    code = f"""
import os, shutil, sys
sys.path.insert(0, {SRC!r})
from torchrepro._child.writes import watch, _announce_torch_saves
watch({str(tmp_path / WRITES_FILE)!r})
_announce_torch_saves()
import torch
open("read.txt", "w").close()         # a write
open("read.txt").read()               # a read: not noted
open("a.txt", "a").close(); open("a.txt", "a").close()
fd = os.open("b.bin", os.O_WRONLY | os.O_CREAT); os.close(fd)
os.mkdir("d"); os.rename("a.txt", "d/c.txt"); os.remove("d/c.txt"); os.rmdir("d")
torch.save({{"x": 1}}, "m.pt"); torch.load("m.pt")
"""
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=user_env(), check=True, timeout=120)
    expected = {"read.txt", "a.txt", "b.bin", "d", "d/c.txt", "m.pt"}
    here = os.path.realpath(tmp_path)
    # only the script's own writes: a coverage run also writes its data file from this process
    written = [json.loads(line)["path"] for line in (tmp_path / WRITES_FILE).read_text().splitlines()]
    written = [p for p in written if p.startswith(here + os.sep)]
    assert set(written) == {p for p in read_writes(tmp_path) if p.startswith(here + os.sep)}
    assert set(written) == {os.path.join(here, p) for p in expected}
    assert len(written) == len(expected)  # each path once


def test_shared_writes_are_those_of_runs_running_together_outside_the_isolation(tmp_path: Path) -> None:
    root, check_dir = str(tmp_path / "cwd"), tmp_path / "cwd" / ".torchrepro" / "checks" / "c"
    records = [check_dir / f"run{i}" for i in range(3)]
    both = ["/elsewhere/out/model.pt", f"{root}/model.pt", f"{records[0]}/events.rank0.jsonl", "/dev/null"]
    for i, record in enumerate(records):
        record.mkdir(parents=True)
        lines = [*both, f"/elsewhere/own{i}"] if i < 2 else ["/elsewhere/out/model.pt"]
        (record / WRITES_FILE).write_text("".join(f'{{"path": "{p}"}}\n' for p in lines) + '{"pa')
    overlay = Isolation(mode="overlay", root=root)
    none = Isolation(mode="none", root=root, reason="--no-isolate")
    kw = {"check_dir": check_dir}
    assert shared_writes(records, [range(3)], isolation=overlay, **kw) == ["/elsewhere/out/model.pt"]
    assert shared_writes(records, [range(3)], isolation=none, **kw) == [
        "/elsewhere/out/model.pt",
        f"{root}/model.pt",
    ]
    assert shared_writes(records, [], isolation=none, **kw) == []  # --serial: never together
    line = describe_shared(["/a", "/b", "/c", "/d"], isolation=overlay)
    assert "/a, /b, /c and 1 more" in line and "--serial" in line and "\n" not in line
