"""Strict JSON reading (``_jsonread``): what is refused, with one line saying why, and what is read."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from torchrepro._jsonread import json_problem, parse_json, read_json
from torchrepro.errors import EnvFileError


def test_read_json_error_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(EnvFileError, match="cannot read"):
        read_json(tmp_path / "missing.json")
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert read_json(tmp_path / "ok.json") == {"a": 1}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'{"seed": NaN}', "NaN or an infinity"),
        (b'{"seed": -Infinity}', "NaN or an infinity"),
        (b'{"seed": 1e999}', "NaN or an infinity"),
        (b'{"seed": ' + b"9" * 5000 + b"}", "an integer of 5000 digits"),
        (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "nested deeper than"),
        (b"[" * 101 + b"]" * 101, "nested deeper than 100 levels"),
        (b'{"x": "\\udc80"}', "not Unicode text"),
        (b'{"x": 1', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8 text"),
    ],
)
def test_read_json_refuses_what_is_not_strict_json(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "f.json"
    path.write_bytes(content)
    with pytest.raises(EnvFileError, match=f"cannot read {re.escape(str(path))}: ") as info:
        read_json(path)
    assert problem in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_json(content)


def test_parse_json_accepts_strict_json_and_nan_only_when_asked() -> None:
    deep = "[" * 100 + "]" * 100  # exactly the limit
    assert parse_json(deep) is not None
    assert parse_json('{"a": [1, 2.5, "\\u00e9", null, true]}') == {"a": [1, 2.5, "é", None, True]}
    assert math.isnan(parse_json("[NaN]", allow_nan=True)[0])
    assert (
        json_problem({"a": [math.inf]}) is not None
        and json_problem({"a": [math.inf]}, allow_nan=True) is None
    )
