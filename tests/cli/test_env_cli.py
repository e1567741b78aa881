"""`torchrepro env [--json]` and `torchrepro env diff A B [--json]`: output shapes and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import user_env
from torchrepro import collect_env
from torchrepro.cli import main


def test_env_json_is_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch_version"] == torch.__version__
    assert data["num_threads"] == torch.get_num_threads()


def test_env_table_is_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch_version" in out and torch.__version__ in out
    assert "env_vars:" in out and "PYTHONHASHSEED" in out


def write(path: Path, data: object) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_env_diff_exit_codes_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = collect_env().to_dict()
    a = write(tmp_path / "a.json", env)
    harmless = write(tmp_path / "b.json", {**env, "hostname": "elsewhere"})
    threads = write(tmp_path / "c.json", {**env, "num_threads": (env["num_threads"] or 1) + 1})

    assert main(["env", "diff", a, a]) == 0
    assert "no difference" in capsys.readouterr().out
    assert main(["env", "diff", a, harmless]) == 0
    out = capsys.readouterr().out
    assert "hostname" in out and "nothing that matters" in out
    assert main(["env", "diff", a, threads]) == 1  # negative control: a changed thread count matters
    out = capsys.readouterr().out
    assert "can break bitwise reproducibility" in out and "num_threads" in out

    assert main(["env", "diff", a, threads, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["breaks"] is True
    (d,) = data["differences"]
    assert d["key"] == "num_threads" and d["breaks"] is True and d["reason"]
    assert main(["env", "--json", "diff", a, harmless]) == 0
    assert json.loads(capsys.readouterr().out)["breaks"] is False


def test_env_diff_accepts_run_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = collect_env().to_dict()
    record = tmp_path / "run1"
    record.mkdir()
    write(record / "env.json", env)
    wrapped = write(tmp_path / "meta.json", {"env": env, "command": ["x"]})
    assert main(["env", "diff", str(record), wrapped]) == 0


@pytest.mark.parametrize("content", [None, "{oops", '{"unrelated": true}', '{"torch_version": 3}'])
def test_env_diff_bad_file_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None
) -> None:
    good = write(tmp_path / "good.json", collect_env().to_dict())
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    assert main(["env", "diff", good, str(bad)]) == 2
    captured = capsys.readouterr()
    assert str(bad) in captured.err and captured.out == ""


def test_env_diff_across_real_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real `torchrepro env --json` process with another thread count differs in what matters."""
    other = "2" if os.environ.get("OMP_NUM_THREADS") == "1" else "1"
    here = write(tmp_path / "here.json", collect_env().to_dict())
    proc = subprocess.run(
        [sys.executable, "-m", "torchrepro", "env", "--json"],
        capture_output=True,
        text=True,
        env=user_env(OMP_NUM_THREADS=other),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    child = write(tmp_path / "child.json", json.loads(proc.stdout))
    assert main(["env", "diff", here, here]) == 0
    capsys.readouterr()
    assert main(["env", "diff", here, child, "--json"]) == 1
    keys = {d["key"] for d in json.loads(capsys.readouterr().out)["differences"] if d["breaks"]}
    assert "env_vars.OMP_NUM_THREADS" in keys
