"""``torchrepro status``: the determinism report of a fresh process started from this shell, as a
table a person reads or as JSON; what the shell sets (PYTHONHASHSEED, threads) shows up in it."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import torchrepro, user_env


def test_status_is_a_table_and_json_of_what_a_fresh_process_gets(tmp_path: Path) -> None:
    plain = torchrepro(tmp_path, "status", env=user_env(drop=("PYTHONHASHSEED", "OMP_NUM_THREADS")))
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    assert lines[0] == "determinism: off mode (not deterministic); process-start settings not fixed"
    rows = {line.split()[1]: line.split()[0] for line in lines[1:] if line.split()[0] in ("ok", "NO")}
    assert rows["deterministic_algorithms"] == "NO" and rows["PYTHONHASHSEED"] == "NO"
    assert rows["warn_only"] == "ok"
    assert "fix: start Python with PYTHONHASHSEED=0" in plain.stdout
    pinned = torchrepro(
        tmp_path,
        "status",
        "--json",
        env=user_env(PYTHONHASHSEED="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"),
    )
    assert pinned.returncode == 0, pinned.stderr
    report = json.loads(pinned.stdout)
    items = {item["name"]: item for item in report["items"]}
    assert report["mode"] == "off" and report["deterministic"] is False
    assert items["PYTHONHASHSEED"]["ok"] is True and items["threads"]["ok"] is True
    assert set(items) == set(rows)  # the table and the JSON name the same settings
