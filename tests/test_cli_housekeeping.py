"""Housekeeping on the command line: -V, JSON errors under --json, torchrepro clean, and the
progress total with --steps."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest

from torchrepro import cli, runrecord


def test_dash_v_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    from torchrepro import __version__

    assert cli.main(["-V"]) == 0
    assert capsys.readouterr().out.strip() == f"torchrepro {__version__}"


def test_a_usage_error_under_json_is_a_json_object_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--json", "--runs", "x", "train.py"]) == 2
    out, err = capsys.readouterr()
    error = json.loads(out)["error"]
    assert error["kind"] == "usage" and error["command"] == "check" and error["exit_code"] == 2
    assert "--runs" in error["message"] and "--runs" in err  # the line on stderr stays
    assert cli.main(["check", "--runs", "x", "train.py"]) == 2
    assert capsys.readouterr().out == ""  # without --json, nothing on stdout
    assert cli.main(["check", "train.py", "--json", "--runs", "x"]) == 2  # the script's own --json
    assert cli.main(["clean", "--json", "--keep", "-1"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["command"] == "clean"


def _record(base: Path, kind: str, stamp: str, age: float) -> Path:
    path = base / kind / f"{stamp}-{os.getpid()}-{os.urandom(6).hex()}"
    (path / "run0").mkdir(parents=True)
    (path / "run0" / "events.rank0.jsonl").write_text("")
    old = time.time() - age
    os.utime(path, (old, old))
    return path


def test_clean_keeps_the_newest_and_never_a_record_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / ".torchrepro"
    runs = [_record(base, "runs", f"2026010{i}-120000", 3600) for i in range(1, 6)]
    checks = [_record(base, "checks", f"2026020{i}-120000", 3600) for i in range(1, 4)]
    busy = checks[0] / "run0" / runrecord.LOCK_FILE
    fd = os.open(busy, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a check still writing its oldest record
    fresh = _record(base, "runs", "20250101-120000", 0)  # oldest name, but changed just now
    (base / "runs" / "notes").mkdir()  # not a record
    try:
        assert cli.main(["clean", "--keep", "2", "--root", str(base), "--dry-run"]) == 0
        assert all(p.exists() for p in [*runs, *checks])  # a dry run removes nothing
        assert "would remove 3 record(s), kept 6" in capsys.readouterr().out
        assert cli.main(["clean", "--keep", "2", "--root", str(base), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    finally:
        os.close(fd)
    assert sorted(report["removed"]) == sorted(str(p) for p in runs[:3])
    assert sorted(report["in_use"]) == sorted([str(checks[0]), str(fresh)])
    assert [p.exists() for p in runs] == [False, False, False, True, True]
    assert all(p.exists() for p in checks) and fresh.exists() and (base / "runs" / "notes").exists()
    assert cli.main(["clean", "--keep", "0", "--root", str(base)]) == 0  # the lock is gone now
    assert not checks[0].exists() and fresh.exists()
