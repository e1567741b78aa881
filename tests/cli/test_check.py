"""``torchrepro check`` process handling: SIGTERM ends every child, concurrent checks, human output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import user_env

SCRIPTS = Path(__file__).parents[1] / "e2e" / "scripts"


def _processes_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


def _describe(pid: int) -> str:
    """State, parent and command line of a process, for a failure message."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: gone"
    return f"{pid}: state {stat[0]}, parent {stat[1]}: {cmdline.strip()}"


def test_sigterm_ends_every_child_process(tmp_path: Path) -> None:
    script = tmp_path / "forever_sigterm_probe.py"
    script.write_text((SCRIPTS / "forever.py").read_text())
    env = user_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrepro", "check", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    # wait until both runs train (events recorded) and their DataLoader workers exist
    # (2 runs x (main + 2 workers)); a loaded machine may start them late
    children: list[int] = []
    while time.monotonic() < deadline:
        events = list(tmp_path.glob(".torchrepro/checks/*/run*/events.rank0.jsonl"))
        if len(events) == 2 and all(p.stat().st_size > 0 for p in events):
            children = _processes_mentioning(script.name)
            if len(children) >= 6:
                break
        time.sleep(0.2)
    assert len(children) >= 6, children
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "interrupted" in err
    # Every process was SIGKILLed before the check exited; on a loaded machine tearing down a
    # few torch processes can take a moment. Two seconds stays well below the 5 s after which a
    # DataLoader worker whose parent died would end by itself, so a worker left alive still fails.
    deadline = time.monotonic() + 2.0
    while _processes_mentioning(script.name) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _processes_mentioning(script.name)
    assert left == [], [_describe(pid) for pid in left]


def test_human_report_and_concurrent_checks_do_not_collide(tmp_path: Path) -> None:
    env = user_env()
    cmd = [sys.executable, "-m", "torchrepro", "check", "--steps", "2", str(SCRIPTS / "unseeded.py")]
    procs = [
        subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.startswith("reproducible: 2 runs identical over 2 training steps")
        assert "steps run 1:" in err  # progress goes to stderr
    checks = list((tmp_path / ".torchrepro" / "checks").iterdir())
    assert len(checks) == 2
    assert all((c / "verdict.json").exists() for c in checks)
