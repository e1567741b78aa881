"""Kill it and compare: a training run SIGKILLed at random moments (some mid-write) and resumed in
fresh processes ends with the same parameter bits as the run that was never interrupted.

The reference and the epoch-boundary resume run ``examples/resume_cnn.py`` as plain fresh
interpreters. The many kill trials run it in processes forked from a *zygote*: an interpreter
that has only imported torch (and the dynamo modules the first optimizer pulls in, ~4 s of CPU)
and the example module, and forks one child per run. Each child is a new process that starts
training from nothing but the checkpoint directory; the zygote only saves the import time. The
test checks that a zygote child and a fresh interpreter give the same bits.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import ROOT
from torchrepro import latest_checkpoint
from torchrepro._io import TMP_SUFFIX

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "resume_cnn.py"
STEPS = 60  # 5 epochs of 12 batches
SLOW_WRITE = "0.003"  # seconds after each write call: a checkpoint save takes ~0.3 s

ZYGOTE = r"""
import sys
import torch, torch._dynamo  # the expensive imports, once
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import forking, resume_cnn

forking.serve(resume_cnn.main)
"""


@dataclass
class Child:
    pid: int
    log: Path

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


class Zygote:
    """Forks example runs from an interpreter that has already imported torch."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(EXAMPLE.parent), str(ROOT / "tests")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.n = 0

    def _ask(self, **cmd: Any) -> int:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(cmd) + "\n")
        stdin.flush()
        answer = stdout.readline()
        assert answer, f"zygote died (exit code {self.proc.poll()})"
        return int(answer)

    def start(self, log_dir: Path, *argv: str, slow: bool = False) -> Child:
        self.n += 1
        log = log_dir / f"run{self.n}.log"
        env = {"RESUME_CNN_SLOW_WRITE": SLOW_WRITE} if slow else {}
        return Child(self._ask(op="run", argv=list(argv), log=str(log), env=env), log)

    def wait(self, child: Child) -> int:
        return self._ask(op="wait", pid=child.pid)

    def run(self, log_dir: Path, *argv: str) -> str:
        child = self.start(log_dir, *argv)
        rc = self.wait(child)
        assert rc == 0, f"example failed (exit {rc}):\n{child.text()}"
        return child.text()

    def close(self) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.close()
        self.proc.wait(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def final_fingerprint(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("fingerprint ")]
    assert len(lines) == 1, f"no final fingerprint in:\n{output}"
    return lines[0].split()[1]


def fresh_process(ckpt: Path, *args: str) -> subprocess.Popen[str]:
    """The example in a brand-new interpreter (started now, collected later)."""
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), str(ckpt), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )


def collect(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, f"example failed (exit {proc.returncode}):\n{out}"
    return out


@dataclass
class Reference:
    fingerprint: str
    train_seconds: float


@pytest.fixture(scope="module")
def reference(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run, forked from the zygote, timed from its first training step."""
    d = tmp_path_factory.mktemp("reference")
    child = zygote.start(d, str(d / "ckpt"))
    while "training from step 0" not in child.text():
        time.sleep(0.005)
    started = time.monotonic()
    assert zygote.wait(child) == 0, child.text()
    return Reference(final_fingerprint(child.text()), time.monotonic() - started)


def wait_for(child: Child, marker: str, count: int = 1, timeout: float = 120.0) -> bool:
    """Wait until ``marker`` appears ``count`` times in the child's log; False if it exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = child.text()
        if text.count(marker) >= count:
            return True
        if "fingerprint " in text or "Traceback" in text:
            return False
        time.sleep(0.003)
    raise AssertionError(f"timed out waiting for {marker!r}:\n{child.text()}")


def started_at(child: Child) -> int:
    """The step the child's log says its training started from (0 when it says none yet)."""
    found = re.search(r"training from step (\d+)", child.text())
    return int(found.group(1)) if found else 0


def assert_no_torn_checkpoint_is_picked(ckpt: Path) -> None:
    """latest_checkpoint returns a complete file (torn temp files are never candidates)."""
    if not ckpt.is_dir():
        return
    latest = latest_checkpoint(ckpt)  # a skipped damaged file would warn, and warnings are errors
    if latest is not None:
        assert not latest.endswith(TMP_SUFFIX)
        payload = torch.load(latest, weights_only=True)
        assert payload["meta"]["names"] == ["model", "optimizer", "scheduler", "loader", "step"]


def test_fresh_interpreters_match_and_resume_at_an_epoch_boundary(
    zygote: Zygote, reference: Reference, tmp_path: Path
) -> None:
    fresh = fresh_process(tmp_path / "fresh")  # uninterrupted, in a brand-new interpreter
    assert "stopped at step 12" in zygote.run(tmp_path, str(tmp_path / "boundary"), "--stop-at", "12")
    resumed = fresh_process(tmp_path / "boundary")  # the end of epoch 0, resumed in a new interpreter
    assert final_fingerprint(collect(fresh)) == reference.fingerprint
    out = collect(resumed)
    assert "resumed from step-00012.pt at step 12" in out
    assert final_fingerprint(out) == reference.fingerprint


def test_resume_twice_within_one_epoch(zygote: Zygote, reference: Reference, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    zygote.run(tmp_path, ckpt, "--stop-at", "26")  # epoch 2, batch 2
    assert "resumed from step-00026.pt at step 26" in zygote.run(tmp_path, ckpt, "--stop-at", "31")
    out = zygote.run(tmp_path, ckpt)  # epoch 2, batch 7 to the end
    assert "resumed from step-00031.pt at step 31" in out
    assert final_fingerprint(out) == reference.fingerprint


def test_naive_resume_without_rng_and_loader_state_differs(
    zygote: Zygote, reference: Reference, tmp_path: Path
) -> None:
    """Negative control: restoring model, optimizer and scheduler alone is not an exact resume."""
    ckpt = str(tmp_path / "ckpt")
    zygote.run(tmp_path, ckpt, "--stop-at", "26")
    out = zygote.run(tmp_path, ckpt, "--no-restore-rng-loader")
    assert "resumed from step-00026.pt at step 26" in out
    assert final_fingerprint(out) != reference.fingerprint


def test_sigkill_at_random_moments_then_resume_matches(
    zygote: Zygote, reference: Reference, tmp_path: Path
) -> None:
    seed = int(os.environ.get("KILL_RESUME_SEED", "20261122"))
    print(f"kill schedule seed: {seed} (set KILL_RESUME_SEED to replay another)")
    rng = random.Random(seed)
    kills = mid_write_kills = torn_temp_files = 0
    for trial in range(10):
        mid_write = trial % 3 == 2  # trials 2, 5, 8: the kill lands while a checkpoint is written
        ckpt = tmp_path / f"trial{trial}"
        kills_left = rng.choice([1, 2])
        while True:
            child = zygote.start(tmp_path, str(ckpt), slow=mid_write and kills_left > 0)
            if kills_left == 0:
                assert zygote.wait(child) == 0, child.text()
                break
            if mid_write:
                alive = wait_for(child, "writing", count=rng.randint(1, 3))
                time.sleep(rng.uniform(0.0, 0.1))
            else:
                alive = wait_for(child, "training from step")
                # Within the training left: a resumed run has fewer steps to go than the reference,
                # and a kill drawn past its end would land on a finished process (no kill at all).
                left = (STEPS - started_at(child)) / STEPS
                time.sleep(rng.uniform(0.0, 0.9 * left * reference.train_seconds))
            os.kill(child.pid, signal.SIGKILL)
            code = zygote.wait(child)
            if code == 0:  # it finished before the kill landed: nothing to resume
                break
            assert alive and code == -signal.SIGKILL, child.text()
            kills += 1
            kills_left -= 1
            temps = list(ckpt.glob(f"*{TMP_SUFFIX}"))
            torn_temp_files += len(temps)
            mid_write_kills += bool(mid_write and temps)
            assert_no_torn_checkpoint_is_picked(ckpt)
        assert final_fingerprint(child.text()) == reference.fingerprint, f"trial {trial} (seed {seed})"
    print(f"{kills} kills, {mid_write_kills} mid-write (left {torn_temp_files} torn temp files)")
    assert kills >= 8
    assert mid_write_kills >= 1, "no kill landed mid-write"
