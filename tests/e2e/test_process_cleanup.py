"""Whatever happens to torchrepro (SIGINT, SIGTERM, SIGKILL), nothing it started outlives it.

Each case starts ``torchrepro run`` or ``check`` on a script that trains with DataLoader workers
and starts a process of its own, signals torchrepro at one phase (running, comparing, locating),
and then looks for any process carrying the test's unique marker: none may be alive 5 s later.
The control shows the search finds what plain python leaves behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import user_env

SCRIPT = """
import os, subprocess, sys, time
import torch
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "MARKER"])  # its own child
data = torch.utils.data.TensorDataset(torch.randn(256, 4))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(100):
    for (x,) in torch.utils.data.DataLoader(data, batch_size=8, num_workers=2):
        noise = int.from_bytes(os.urandom(2), "little") * 1e-9  # differs run to run: a divergence
        opt.zero_grad()
        (model(x).sum() + noise * model.weight.sum()).backward()
        opt.step()
        time.sleep(0.1)
"""


def _alive(marker: str) -> list[str]:
    """``<pid> <command line>`` of every live process whose command line holds ``marker`` (what
    ``pgrep -af`` prints, read from /proc: procps is not installed on every machine)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # gone meanwhile
            continue
        if marker in cmdline and state != "Z":
            found.append(f"{entry} {cmdline.strip()}")
    return found


def _kill_all(marker: str) -> None:
    """SIGKILL every process :func:`_alive` finds (the test's own, by its unique marker)."""
    for line in _alive(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def _wait_gone(marker: str, seconds: float = 15.0) -> list[str]:  # a loaded 2-core CI machine is slow
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = _alive(marker)
        if not left:
            return []
        time.sleep(0.2)
    return _alive(marker)


def _wait_for(what: Callable[[], bool], seconds: float = 90.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "the phase was never reached"
        time.sleep(0.05)


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    marker = str(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("MARKER", marker))
    env = user_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrepro", *args, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc, marker


def _check_dir(tmp_path: Path) -> Path | None:
    root = tmp_path / ".torchrepro" / "checks"
    dirs = list(root.iterdir()) if root.is_dir() else []
    return dirs[0] if dirs else None


def _has_events(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


PHASES: dict[str, tuple[list[str], Callable[[Path], bool]]] = {
    # both runs started and recording
    "running": (["check"], lambda d: _has_events(d / "run1" / "events.rank0.jsonl")),
    # --serial: run 1 finished, the others are compared live against it
    "comparing": (
        ["check", "--serial", "--steps", "6"],
        lambda d: _has_events(d / "run1" / "events.rank0.jsonl"),
    ),
    # the traced re-runs of the divergent step
    "locating": (["check"], lambda d: (d / "locate0").is_dir()),
}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("phase", list(PHASES))
def test_nothing_outlives_a_signalled_check(tmp_path: Path, phase: str, sig: int) -> None:
    args, reached = PHASES[phase]
    proc, marker = _start(tmp_path, *args)
    try:
        _wait_for(lambda: (d := _check_dir(tmp_path)) is not None and reached(d))
        assert _alive(marker), "the check's processes should be running now"
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        assert _wait_gone(marker) == []
        if sig == signal.SIGTERM:
            assert proc.returncode == 128 + signal.SIGTERM
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        _kill_all(marker)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: signal.Signals(s).name
)
def test_nothing_outlives_a_signalled_run(tmp_path: Path, sig: int) -> None:
    proc, marker = _start(tmp_path, "run", "--record", str(tmp_path / "rec"))
    try:
        _wait_for(lambda: _has_events(tmp_path / "rec" / "events.rank0.jsonl"))
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C in a terminal: the whole foreground group
        else:
            os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        assert _wait_gone(marker) == []
        if sig != signal.SIGKILL:
            assert proc.returncode == 128 + sig
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        _kill_all(marker)


def test_control_plain_python_leaves_its_child_behind(tmp_path: Path) -> None:
    """The search does find leftovers: a SIGKILLed plain python leaves the script's own child."""
    marker = str(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("MARKER", marker))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, start_new_session=True)
    try:
        _wait_for(lambda: len(_alive(marker)) >= 2)
        proc.kill()
        proc.wait()
        time.sleep(1.0)
        assert any("time.sleep(300)" in line for line in _alive(marker))
    finally:
        _kill_all(marker)


@pytest.mark.slow
def test_ctrl_c_on_nproc_2_prints_a_few_lines_and_leaves_nothing(tmp_path: Path) -> None:
    marker = str(tmp_path)
    script = tmp_path / "ddp_wait.py"
    script.write_text(
        "import time, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        f"open({marker!r} + f'/rank{{dist.get_rank()}}.ready', 'w').close()\n"
        "time.sleep(300)\n"
    )
    env = user_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrepro", "run", "--nproc", "2", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(lambda: (tmp_path / "rank0.ready").exists() and (tmp_path / "rank1.ready").exists())
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGINT
        after_start = [line for line in err.splitlines() if "torch/distributed/run.py" not in line]
        assert len(after_start) <= 3, err  # not every rank's and the agent's tracebacks
        assert "Traceback" not in err and "interrupted" in err
        assert _wait_gone(marker) == []
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        _kill_all(marker)
