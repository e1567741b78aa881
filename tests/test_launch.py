"""The launcher: child environments, commands, process-tree cleanup, relaunch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchrepro.errors import LaunchError
from torchrepro.flags import CUBLAS_CONFIGS, CUBLAS_VAR
from torchrepro.launch import (
    build_command,
    child_env,
    descendants,
    kill_tree,
    python_hash_seed,
)


def test_child_env_sets_process_start_settings_from_the_seed() -> None:
    env = child_env(
        seed=7, mode="warn", threads=2, record_dir="/r", base={"PATH": "/bin", "TORCHREPRO_X": "1"}
    )
    assert env["PYTHONHASHSEED"] == str(python_hash_seed(7))
    assert env["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_CONFIGS[0]
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["TORCHREPRO_THREADS"] == "2"
    assert (env["TORCHREPRO_SEED"], env["TORCHREPRO_MODE"], env["TORCHREPRO_RECORD_DIR"]) == (
        "7",
        "warn",
        "/r",
    )
    assert "TORCHREPRO_X" not in env  # the caller's own switches never leak into a child
    assert env["PATH"] == "/bin"


def test_child_env_without_seed_is_plain_python() -> None:
    env = child_env(seed=None, base={"PYTHONHASHSEED": "5"})
    assert env == {"PYTHONHASHSEED": "5"}


def test_python_hash_seed_changes_with_seed_and_stays_in_range() -> None:
    seeds = {python_hash_seed(s) for s in range(100)}
    assert len(seeds) == 100
    assert all(0 <= s < 2**32 for s in seeds)
    assert python_hash_seed(0, "vary", 1) != python_hash_seed(0)


@pytest.mark.parametrize(("bad", "match"), [({"seed": -1}, "seed"), ({"seed": 0, "mode": "loose"}, "mode")])
def test_child_env_rejects_bad_settings(bad: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        child_env(**bad)  # type: ignore[arg-type]


def test_build_command_plain_and_torchrun() -> None:
    assert build_command("t.py", ["--x"]) == [
        sys.executable,
        "-m",
        "torchrepro._child.bootstrap",
        "--",
        "t.py",
        "--x",
    ]
    cmd = build_command(None, ["a"], module="pkg.train", nproc=2)
    assert cmd[:3] == [sys.executable, "-m", "torchrepro._child.torchrun"]
    assert "--nproc-per-node=2" in cmd and "--standalone" in cmd
    assert cmd[-5:] == ["-m", "torchrepro._child.bootstrap", "-m", "pkg.train", "a"]
    with pytest.raises(LaunchError):
        build_command(None)
    with pytest.raises(LaunchError, match="nproc"):
        build_command("t.py", nproc=0)


def test_kill_tree_ends_descendants_in_other_sessions() -> None:
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    kids = descendants(proc.pid)
    assert len(kids) == 1
    kill_tree(proc.pid)
    proc.wait(timeout=10)
    proc.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{kids[0]}").exists():
        state = Path(f"/proc/{kids[0]}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":  # killed, waiting for init to reap it
            break
        time.sleep(0.05)
    else:
        assert not Path(f"/proc/{kids[0]}").exists()


RELAUNCH_SCRIPT = """
import os, sys
print("top", os.getpid(), flush=True)
import torchrepro
torchrepro.relaunch(seed=3)
import torch
print("hash", hash("reproducible"), os.environ.get("PYTHONHASHSEED"), torch.rand(1).item(), flush=True)
"""


def _run(script: Path, env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(script), "arg"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_relaunch_reexecs_once_with_a_pinned_hash_seed_and_is_a_no_op_when_in_place(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(RELAUNCH_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "TORCHREPRO_RELAUNCHED")}
    first = _run(script, env)
    tops = [line for line in first if line.startswith("top")]
    assert len(tops) == 2 and tops[0] == tops[1]  # re-executed exactly once, same pid (execve)
    second = _run(script, env)
    assert first[-1] == second[-1]  # same hash order and same torch draw in a fresh process
    assert first[-1].split()[2] == str(python_hash_seed(3))
    # already in place: no re-exec
    in_place = _run(script, {**env, "PYTHONHASHSEED": str(python_hash_seed(3))})
    assert sum(line.startswith("top") for line in in_place) == 1
    assert in_place[-1] == first[-1]
    # negative control: without relaunch, string hashes differ between two fresh interpreters
    plain = tmp_path / "plain.py"
    plain.write_text('print(hash("reproducible"))\n')
    runs = {_run(plain, env)[-1] for _ in range(2)}
    assert len(runs) == 2


def test_relaunch_under_torchrun_reexecs_each_rank_in_place(tmp_path: Path) -> None:
    script = tmp_path / "ddp.py"
    script.write_text(
        "import os, sys\n"
        "log = open(os.path.join(os.path.dirname(__file__), 'out' + os.environ['RANK']), 'a')\n"
        "print('top', os.getpid(), file=log, flush=True)\n"
        "import torchrepro\n"
        "torchrepro.relaunch(seed=3)\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('ready', os.getpid(), os.environ['PYTHONHASHSEED'], dist.get_rank(), file=log, flush=True)\n"
        # both ranks finish connecting before either leaves (a rank that exits right after its own
        # init can close the connection the other is still completing, under load)
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "TORCHREPRO_RELAUNCHED")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    for rank in ("0", "1"):
        lines = (tmp_path / f"out{rank}").read_text().splitlines()
        tops = [line.split()[1] for line in lines if line.startswith("top ")]
        ready = [line.split() for line in lines if line.startswith("ready ")]
        assert len(tops) == 2 and tops[0] == tops[1]  # one re-exec, same pid: the agent still sees it
        assert len(ready) == 1, lines
        assert ready[0][1:] == [tops[0], str(python_hash_seed(3)), rank]  # rank variables kept


@pytest.mark.parametrize("mode", ["strict", "warn", "off"])
def test_relaunch_sets_the_cublas_value_flags_decides(
    mode: str, monkeypatch: pytest.MonkeyPatch, rng_changes_ok: None
) -> None:
    """relaunch asks ``flags`` which CUBLAS_WORKSPACE_CONFIG a process starts with; it no longer decides
    itself (it set ``:4096:8`` even in mode ``off``, which leaves the variable as it is)."""
    from torchrepro import _runtime, flags, launch

    monkeypatch.setenv("PYTHONHASHSEED", "0")  # nothing else is missing: no re-exec
    monkeypatch.delenv(CUBLAS_VAR, raising=False)
    monkeypatch.setitem(_runtime._BOOTSTRAP, "configured", False)
    # CUDA not started, so the variable is set in place: on a machine with a GPU an earlier test
    # in this process may have started it, and relaunch would re-execute pytest itself
    monkeypatch.setattr(launch, "cuda_started", lambda: False)
    saved = flags.DeterminismFlags.capture()
    try:
        launch.relaunch(seed=1, mode=mode)
        assert os.environ.get(CUBLAS_VAR) == flags.cublas_start_value(mode, None)
    finally:
        saved.restore()
        os.environ.pop(CUBLAS_VAR, None)
    assert (os.environ.get(CUBLAS_VAR), flags.cublas_start_value("off", None)) == (None, None)


@pytest.mark.parametrize(("current", "expected"), [(None, ":4096:8"), (":1:1", ":4096:8"), (":16:8", None)])
def test_cublas_start_value_replaces_what_pytorch_refuses(current: str | None, expected: str | None) -> None:
    from torchrepro.flags import cublas_start_value

    assert cublas_start_value("strict", current) == cublas_start_value("warn", current) == expected
    assert cublas_start_value("off", current) is None


def test_a_signal_while_a_process_starts_is_delivered_once_its_handle_is_held(tmp_path: Path) -> None:
    """SIGTERM (or Ctrl-C) that lands inside ``subprocess.Popen`` would raise before the caller
    holds the child, and nothing could end it: under ``signals_held`` it is delivered after."""
    import threading

    from torchrepro.launch import Terminated, signals_held, terminate_on_signals

    assert threading.current_thread() is threading.main_thread()  # where Python runs signal handlers
    started: list[subprocess.Popen[bytes]] = []
    with pytest.raises(Terminated), terminate_on_signals(), signals_held():
        os.kill(os.getpid(), signal.SIGTERM)  # as if it came during the start
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    (child,) = started  # the handle was kept: the caller can end the child
    child.kill()
    child.wait()
    # the handlers in place before are back, and nothing is held afterwards
    with pytest.raises(KeyboardInterrupt), signals_held():
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(Terminated), terminate_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # delivered at once, not held
            time.sleep(0.01)


def _gone(pid: int, seconds: float = 10) -> bool:
    """Whether ``pid`` ended (or is a zombie waiting to be reaped) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("supervised", [True, False])
def test_the_script_dies_with_its_supervisor_even_when_only_the_supervisor_is_killed(
    supervised: bool,
) -> None:
    # the supervisor SIGKILLed alone (a kill_tree that listed it before it had started the script):
    # the script, armed with PR_SET_PDEATHSIG before its exec, dies too. The control: a plain parent
    # SIGKILLed alone leaves its child running.
    from torchrepro.launch import spawn

    child = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"]
    if supervised:
        proc = spawn(child, env=dict(os.environ), stdout=subprocess.PIPE, text=True)
    else:
        code = f"import subprocess, time; subprocess.Popen({child!r}); time.sleep(60)"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        (script,) = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert _gone(script, seconds=10 if supervised else 2) is supervised
    finally:
        kill_tree(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(script, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()
