"""``_child.children`` and its ``sitecustomize``: which processes are adopted, and which rank
file a process may claim. Real interpreters for the start-up behaviour; the claim in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SRC, user_env
from torchrepro import runrecord
from torchrepro._child.children import _is_multiprocessing, _started_module
from torchrepro._child.rankclaim import RankClaim
from torchrepro.errors import LaunchError
from torchrepro.launch import check_target
from torchrepro.protocol import PARENT_RANK_VAR, SITE_DIR, ChildSpec

PROBE = (
    "import sys, json, torch;"
    "print(json.dumps([torch.rand(3).tolist(), torch.are_deterministic_algorithms_enabled()]))"
)


def _python(code: str, env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_a_python_started_in_a_recorded_run_is_seeded_and_strict(tmp_path: Path) -> None:
    env = ChildSpec(seed=7, record_dir=str(tmp_path)).to_env(user_env())
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [SITE_DIR, SRC]
    a, b = (json.loads(_python(PROBE, env, tmp_path)) for _ in range(2))
    assert a == b and a[1] is True
    # negative control: the same python without the run's protocol is neither seeded nor strict
    plain = {k: v for k, v in env.items() if not k.startswith("TORCHREPRO_")}
    c, d = (json.loads(_python(PROBE, plain, tmp_path)) for _ in range(2))
    assert c[0] != d[0] and c[1] is False


def test_outside_a_run_the_sitecustomize_imports_no_torch_and_chains_to_the_users(tmp_path: Path) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITE_RAN = True\n")
    env = user_env()
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, env["PYTHONPATH"], str(user)])
    code = "import sys, builtins; print('torch' in sys.modules, getattr(builtins, 'USER_SITE_RAN', False))"
    assert _python(code, env, tmp_path) == "False True"


def test_torchrepro_processes_and_the_resource_tracker_are_not_adopted() -> None:
    py = sys.executable
    bootstrap = "torchrepro._child.bootstrap"
    assert _started_module([py, "-u", "-m", bootstrap, "x.py"]) == bootstrap
    assert _started_module([py, "script.py", "-m", "x"]) is None
    assert _started_module([py, "-c", "pass"]) is None
    spawned = [py, "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"]
    assert _is_multiprocessing(spawned)
    assert _is_multiprocessing([py, "-c", "from multiprocessing.resource_tracker import main;main(5)"])
    assert not _is_multiprocessing([py, "-c", "import torch"])
    assert not _is_multiprocessing([py, "train.py"])


def _claim(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, main: bool, env: dict[str, str]) -> RankClaim:
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", PARENT_RANK_VAR):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():  # monkeypatch restores them, and the mark the claim leaves
        monkeypatch.setenv(name, value)
    return RankClaim(str(tmp_path), main=main)


def test_a_child_claims_its_own_environment_rank_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    claim = _claim(monkeypatch, tmp_path, main=False, env={"LOCAL_RANK": "1", PARENT_RANK_VAR: "0"})
    opened = claim.open()
    assert opened is not None and opened[0] == runrecord.events_path(tmp_path, 1) and claim.rank == 1
    opened[1].close()
    assert os.environ[PARENT_RANK_VAR] == "1"  # what the processes it starts inherit
    # a second process naming the same rank never writes that file
    again = _claim(monkeypatch, tmp_path, main=False, env={"RANK": "1", PARENT_RANK_VAR: "0"})
    assert again.open() is None and again.rank is None
    assert any("rank 1, whose events another process" in line for line in runrecord.read_uncovered(tmp_path))


def test_an_inherited_rank_is_not_a_childs_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    claim = _claim(monkeypatch, tmp_path, main=False, env={"RANK": "0", PARENT_RANK_VAR: "0"})
    assert claim.open() is None
    assert not runrecord.events_path(tmp_path, 0).exists()
    (line,) = runrecord.read_uncovered(tmp_path)
    assert "no RANK or LOCAL_RANK of its own" in line
    # the process torchrepro started defaults to its RANK, or 0
    main = _claim(monkeypatch, tmp_path, main=True, env={})
    opened = main.open()
    assert opened is not None and main.rank == 0
    opened[1].close()


def test_world_notes_name_every_rank(tmp_path: Path) -> None:
    runrecord.write_world(tmp_path, 0, 3)
    (tmp_path / "world.rank1.json").write_text("{not json")
    assert runrecord.read_world(tmp_path) == {0: 3}
    assert runrecord.ranks_present(tmp_path) == {0, 1, 2}


@pytest.mark.parametrize(
    ("script", "module", "args", "expected"),
    [
        ("torchrun", None, ["--nproc-per-node=2", "train.py", "--lr", "1"], "--nproc 2 train.py --lr 1"),
        (None, "torch.distributed.run", ["--nproc_per_node", "4", "t.py"], "--nproc 4 t.py"),
        ("/venv/bin/accelerate", None, ["launch", "--num_processes", "2", "t.py"], "--nproc 2 t.py"),
    ],
)
def test_rank_launchers_are_refused_with_the_nproc_command(
    script: str | None, module: str | None, args: list[str], expected: str
) -> None:
    with pytest.raises(LaunchError, match="is not supported") as info:
        check_target(script, module, args, command="check")
    assert f"`torchrepro check {expected}`" in str(info.value)
