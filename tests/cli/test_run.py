"""``torchrepro run``: __main__ semantics, process-start settings, the run record, -m, compare."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from helpers import torchrepro
from torchrepro.launch import python_hash_seed
from torchrepro.runrecord import read_events

SCRIPTS = Path(__file__).parent / "scripts"


def info(out: str) -> dict[str, Any]:
    line = next(x for x in out.splitlines() if x.startswith("INFO "))
    result: dict[str, Any] = json.loads(line[5:])
    return result


def test_run_gives_main_semantics_settings_and_a_complete_record(tmp_path: Path) -> None:
    script = SCRIPTS / "semantics.py"
    proc = torchrepro(
        tmp_path, "run", "--seed", "5", "--threads", "1", "--record", "rec", str(script), "--lr", "3"
    )
    assert proc.returncode == 3, proc.stderr  # the script's exit code passes through
    got = info(proc.stdout)
    assert got["name"] == "__main__"
    assert got["argv"] == [str(script), "--lr", "3"]
    assert got["path0"] == str(SCRIPTS)
    assert got["hashseed"] == str(python_hash_seed(5))
    assert got["cublas"] == ":4096:8"
    assert got["initial_seed"] == 5  # the seed itself, as torch.manual_seed(5)
    assert got["threads"] == 1
    assert got["deterministic"] is True
    record = tmp_path / "rec"
    assert {p.name for p in record.iterdir()} >= {
        "command.json",
        "settings.json",
        "env.json",
        "events.rank0.jsonl",
    }
    assert json.loads((record / "settings.json").read_text())["seed"] == 5
    events = read_events(record / "events.rank0.jsonl")
    kinds = Counter((e["kind"], e["key"]) for e in events)
    assert kinds == {
        ("init", "optimizer0"): 1,
        ("data", "loader0"): 4,  # 2 epochs x 2 batches, counted across epochs
        ("compute", "optimizer0"): 4,
        ("data", "loader1"): 4,  # the validation loader is keyed apart
        ("record", "val"): 4,
        ("compute", "final"): 1,  # the state at exit of the module the script's globals hold
    }
    assert [e["step"] for e in events if e["key"] == "loader0"] == [0, 1, 2, 3]
    assert [e["step"] for e in events if e["kind"] == "record"] == [2, 2, 4, 4]


def test_run_module_and_plain_python_equivalence(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import sys, torch\nprint('MOD', __name__, sys.argv[1:], torch.rand(1).item())\nsys.exit(0)\n"
    )
    proc = torchrepro(tmp_path, "run", "--record", "r1", "-m", "mypkg.train", "x", "--y")
    assert proc.returncode == 0, proc.stderr
    again = torchrepro(tmp_path, "run", "--record", "r2", "-m", "mypkg.train", "x", "--y")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MOD"))
    assert line.startswith("MOD __main__ ['x', '--y']")
    assert line == next(x for x in again.stdout.splitlines() if x.startswith("MOD"))
    missing = torchrepro(tmp_path, "run", "-m", "no_such_mod_xyz")
    assert missing.returncode == 2 and "no_such_mod_xyz" in missing.stderr


def test_compare_two_recorded_runs(tmp_path: Path) -> None:
    script = SCRIPTS / "semantics.py"
    with ThreadPoolExecutor(4) as pool:  # independent runs: start them together
        runs = list(
            pool.map(
                lambda ns: torchrepro(
                    tmp_path, "run", "--seed", ns[1], "--record", ns[0], str(script), *ns[2:]
                ),
                (("a", "1"), ("b", "1"), ("c", "2"), ("d", "1", "--workers", "2")),
            )
        )
    for proc in runs:
        assert proc.returncode == 3, proc.stderr
    same = torchrepro(tmp_path, "compare", "a", "b", "--json")
    assert same.returncode == 0, same.stderr
    verdict = json.loads(same.stdout)
    assert verdict["reproducible"] is True and verdict["steps_compared"] == 4
    assert not any(note.startswith("started with different") for note in verdict["notes"])
    differ = torchrepro(tmp_path, "compare", "a", "c", "--json")
    assert differ.returncode == 1, differ.stderr
    verdict = json.loads(differ.stdout)
    # the one real cause is named, before the environment
    assert [n for n in verdict["notes"] if n.startswith("started")] == ["started with different seed: 1 vs 2"]
    args = json.loads(torchrepro(tmp_path, "compare", "a", "d", "--json").stdout)
    assert args["notes"][0] == "started with different arguments: '' vs '--workers 2'"
    assert verdict["first_divergence"]["kind"] == "init" and verdict["first_divergence"]["step"] == 0
    assert verdict["tensor"]["leaf"] == 0 and verdict["tensor"]["shape"] == [2, 3]
    assert verdict["tensor"]["max_abs_diff"] > 0  # a small tensor: its values were stored
    human = torchrepro(tmp_path, "compare", "a", "c")
    assert human.returncode == 1 and "init at step 0" in human.stdout
    assert "started with different seed: 1 vs 2" in human.stdout
    bad = torchrepro(tmp_path, "compare", "a", "nope")
    assert bad.returncode == 2 and "nope" in bad.stderr
