"""Ranks end through the interpreter's exit, as plain python ends them: nothing a rank left open is
lost (issue 31), and torch's gloo abort at exit does not happen (``_child.teardown``).

The script (``exit_scripts/open_files.py``) keeps a gzip log and a zip archive open until the process
ends; only ``close()``, which the interpreter's exit calls, writes the gzip trailer and the zip
central directory. Each launcher of ours is tried beside the plain one as the control: plain
``torchrun`` leaves both files intact (ranks a script spawns itself end as under plain ``python``),
and a process that skips the finalization (``os._exit``, what ranks did before) leaves both unreadable.
``--late`` ends rank 0 the way that makes torch 2.13's gloo abort at exit (the script says how):
plain launchers abort in most such runs (a race, so counted in ``benchmarks/exit_aborts.py``, not
asserted here); ours end with exit code 0 and intact files every time, the race set up (the worker's
decref still pending when the script ended).
"""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import check_json, free_port, torchrepro, user_env

SCRIPT = Path(__file__).resolve().parent / "exit_scripts" / "open_files.py"
ABORT = "terminate called without an active exception"

pytestmark = pytest.mark.slow


def _problems(directory: Path) -> list[str]:
    """What is wrong with both ranks' gzip logs and zip archives in ``directory`` (nothing: [])."""
    problems = []
    for rank in (0, 1):
        try:
            with gzip.open(directory / f"log.rank{rank}.gz", "rt") as f:
                lines = f.read().splitlines()
            if [line.split()[:2] for line in lines] != [["step", "0"], ["step", "1"], ["step", "2"]]:
                problems.append(f"log.rank{rank}.gz holds {lines}")
        except (OSError, EOFError) as exc:
            problems.append(f"log.rank{rank}.gz: {exc}")
        try:
            with zipfile.ZipFile(directory / f"archive.rank{rank}.zip") as z:
                if z.namelist() != ["step0.txt", "step1.txt", "step2.txt"] or z.testzip() is not None:
                    problems.append(f"archive.rank{rank}.zip holds {z.namelist()}")
        except (OSError, zipfile.BadZipFile) as exc:
            problems.append(f"archive.rank{rank}.zip: {exc}")
    return problems


def _plain(cwd: Path, *, spawn: bool = False) -> subprocess.CompletedProcess[str]:
    """The script under plain ``torchrun --nproc-per-node 2``, or plain ``python`` spawning its ranks."""
    if spawn:
        command = [sys.executable, str(SCRIPT), "--spawn", str(free_port())]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        command += ["--master-port", str(free_port()), str(SCRIPT)]
    env = user_env(OMP_NUM_THREADS="1")
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def _plain_clean(cwd: Path, *, spawn: bool = False, tries: int = 8) -> subprocess.CompletedProcess[str]:
    """A plain launch (``_plain``) launched again until no rank aborts at exit: plain launchers
    abort in some launches (torch's race; plain python's spawned ranks in about a third here), and
    what plain python keeps is what a clean ending keeps."""
    for _ in range(tries):
        shutil.rmtree(cwd, ignore_errors=True)
        cwd.mkdir()
        proc = _plain(cwd, spawn=spawn)
        if ABORT not in proc.stderr:
            assert proc.returncode == 0, proc.stderr[-3000:]
            return proc
    raise AssertionError(f"every one of {tries} plain launches aborted at exit")


def test_the_integrity_check_fails_for_files_a_process_never_closed(tmp_path: Path) -> None:
    """The negative control of every test below: skipping the finalization (``os._exit``) loses
    both files on both ranks, and ``_problems`` says so."""
    code = (
        "import gzip, os, zipfile\n"
        "for rank in (0, 1):\n"
        "    log = gzip.open(f'log.rank{rank}.gz', 'wt'); log.write('step 0 loss 1\\n'); log.flush()\n"
        "    z = zipfile.ZipFile(f'archive.rank{rank}.zip', 'w'); z.writestr('step0.txt', '1')\n"
        "    globals()[f'keep{rank}'] = (log, z)\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=60)
    problems = _problems(tmp_path)
    assert len(problems) == 4, problems
    assert any("end-of-stream marker" in p for p in problems), problems
    assert any("not a zip file" in p for p in problems), problems


def test_plain_torchrun_keeps_open_files(tmp_path: Path) -> None:
    """The control: plain ``torchrun`` closes what the ranks left open (in a launch that torch's
    race at exit did not abort)."""
    _plain_clean(tmp_path / "plain")
    assert _problems(tmp_path / "plain") == []


def test_run_nproc_keeps_open_files_and_ends_the_late_case_cleanly(tmp_path: Path) -> None:
    """``torchrepro run --nproc 2``: the ranks end through the interpreter's exit, after the gloo
    workers finished: exit 0, no abort, both files intact on both ranks, in the ``--late`` case
    too, whose race was set up."""
    proc = torchrepro(tmp_path, "run", "--nproc", "2", str(SCRIPT), "--late", env=user_env(LATE_REPORT="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ABORT not in proc.stderr
    assert "late: a decref was pending at the script's end: True" in proc.stdout, proc.stdout
    assert _problems(tmp_path) == []


def test_ranks_a_script_spawns_end_as_plain_python_ends_them(tmp_path: Path) -> None:
    """``mp.spawn`` ranks under ``torchrepro run`` end through the interpreter's exit as under plain
    python: the same files whole or lost (with torch imported, plain python's spawned ranks lose
    module globals left open: nothing to keep beyond what plain python keeps), and the ``--late``
    case ends with exit code 0."""
    for name in ("run", "late"):
        (tmp_path / name).mkdir()
    plain = _plain_clean(tmp_path / "plain", spawn=True)
    ours = torchrepro(tmp_path / "run", "run", str(SCRIPT), "--spawn", str(free_port()))
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert _problems(tmp_path / "run") == _problems(tmp_path / "plain"), plain.stderr[-3000:]
    env = user_env(LATE_REPORT="1")
    late = torchrepro(tmp_path / "late", "run", str(SCRIPT), "--spawn", str(free_port()), "--late", env=env)
    assert late.returncode == 0, late.stderr[-3000:]
    assert ABORT not in late.stderr
    assert "late: a decref was pending at the script's end: True" in late.stdout, late.stdout


def test_check_keeps_each_runs_open_files(tmp_path: Path) -> None:
    """``check --nproc 2``: every run's own files (kept in its ``files/``) are whole, the user's
    directory is untouched, and the check is conclusive, in the ``--late`` case too."""
    code, verdict, err = check_json(tmp_path, "--nproc", "2", str(SCRIPT), "--late")
    assert (code, verdict["reproducible"]) == (0, True), (verdict, err[-3000:])
    assert ABORT not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".torchrepro"]
    check_dir = tmp_path / err.split("torchrepro check: records in ")[1].splitlines()[0]
    for run in ("run0", "run1"):
        assert _problems(check_dir / run / "files") == [], run
