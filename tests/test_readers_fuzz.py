"""Fuzzing the record and environment readers through the CLI (issue 13, "reading what others wrote").

Hypothesis writes run records and environment files the way a damaged disk, a killed run or a
hand-edited file would: random JSON values in place of events, fields of the wrong type, missing
fields, truncated lines, NaN, huge integers, deep nesting, bytes that are not UTF-8. Each pair is fed
to ``torchrepro compare A B --json`` and ``torchrepro env diff A B --json`` in process. Whatever the
input: the exit code is 0, 1 or 2 and nothing else escapes; with 0/1 stdout is one strict JSON object
(no NaN/Infinity); malformed input gives exit 2 and a one-line message naming the file (and the line,
for events). What counts as malformed is decided here, independently of the readers, from the format
(``recorder.py``: kind, key, step, fp, t). The runs are derandomized (deterministic) and small.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from torchrepro.cli import main
from torchrepro.env import Environment, diff_env
from torchrepro.errors import EnvFileError
from torchrepro.runrecord import EventTail, read_events

FUZZ = settings(
    max_examples=120,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
KINDS = ("init", "data", "compute", "record")
INT64_MAX = 2**63 - 1
DEEP = 100_000  # deeper than any recursion limit: json raises RecursionError
HUGE = "9" * 5000  # more digits than Python converts (ValueError)


# --- what the output must be ------------------------------------------------------------------------


def strict_json(text: str) -> Any:
    def refuse(token: str) -> Any:
        raise AssertionError(f"{token} in --json output: not valid JSON")

    return json.loads(text, parse_constant=refuse)


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code in (0, 1, 2, 3), (argv, code, err)
    return code, out, err


def assert_refused(code: int, out: str, err: str, command: str, path: Path, line: int | None = None) -> None:
    assert code == 2, f"malformed {path} (line {line}) was accepted: exit {code}\n{out}{err}"
    if out:  # under --json, stdout holds the error as one JSON object, the same words as stderr
        error = strict_json(out)["error"]
        assert (error["command"], error["exit_code"]) == (command.split()[0], 2), out
        assert err == f"torchrepro {command}: error: {error['message']}\n", (out, err)
    assert err.startswith(f"torchrepro {command}: error: ") and err.count("\n") == 1, err
    assert str(path) in err, err
    if line is not None:
        assert f", line {line}: " in err, err


def assert_json_result(code: int, out: str, err: str) -> dict[str, Any]:
    assert code in (0, 1, 3), err
    data = strict_json(out)
    assert isinstance(data, dict)
    return data


# --- an independent statement of the event format ---------------------------------------------------


def _text(x: Any) -> bool:
    if not isinstance(x, str):
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _index(x: Any) -> bool:
    return type(x) is int and 0 <= x <= INT64_MAX


def _number(x: Any) -> bool:
    if type(x) is float:
        return True
    if type(x) is not int:
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


def is_event(e: Any) -> bool:
    if not isinstance(e, dict) or not all(k in e for k in ("kind", "key", "step", "fp", "t")):
        return False
    if not (isinstance(e["kind"], str) and e["kind"] in KINDS) or not _index(e["step"]):
        return False
    if not (_text(e["key"]) and _text(e["fp"]) and isinstance(e["t"], list)):
        return False
    for leaf in e["t"]:
        if not isinstance(leaf, dict) or not all(k in leaf for k in ("fp", "dtype", "shape")):
            return False
        if not (_text(leaf["fp"]) and _text(leaf["dtype"]) and isinstance(leaf["shape"], list)):
            return False
        if not all(_index(n) for n in leaf["shape"]):
            return False
        if "v" in leaf and not (isinstance(leaf["v"], list) and all(_number(x) for x in leaf["v"])):
            return False
    return True


def line_status(raw: bytes) -> bool | None:
    """None: a blank line (skipped); True: a well-formed event; False: malformed."""
    if not raw.strip():
        return None
    try:
        value = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and too many digits are ValueErrors
        return False
    return is_event(value)


# --- strategies ---------------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
leaves = st.fixed_dictionaries(
    {
        "fp": st.sampled_from(["p", "q"]),
        "dtype": st.sampled_from(["float32", "int64"]),
        "shape": st.lists(st.integers(0, 4), max_size=2),
    },
    optional={"v": st.lists(st.floats() | st.integers(-5, 5), max_size=3)},  # NaN and inf included
)
events = st.fixed_dictionaries(
    {
        "i": st.integers(0, 9),
        "kind": st.sampled_from(KINDS),
        "key": st.sampled_from(["optimizer0", "loader0", "loss"]),
        "step": st.integers(0, 3),
        "fp": st.sampled_from(["a", "b"]),  # few values: runs often agree, and sometimes differ
        "t": st.lists(leaves, max_size=2),
    }
)
FIELDS = ("kind", "key", "step", "fp", "t")


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8")


@st.composite
def event_lines(draw: st.DrawFn) -> bytes:
    """One events line (without its newline): mostly well formed, otherwise damaged in one way."""
    e = draw(events)
    how = draw(
        st.sampled_from(
            [
                "good",
                "good",
                "good",
                "good",
                "wrong_type",
                "missing",
                "any_value",
                "truncated",
                "not_utf8",
                "huge_int",
                "deep",
                "nested_ok",
                "surrogate",
                "nan_step",
                "bad_leaf",
                "blank",
            ]
        )
    )
    if how == "good":
        return _dumps(e)
    if how == "wrong_type":
        return _dumps({**e, draw(st.sampled_from(FIELDS)): draw(json_values)})
    if how == "missing":
        name = draw(st.sampled_from(FIELDS))
        return _dumps({k: v for k, v in e.items() if k != name})
    if how == "any_value":
        return _dumps(draw(json_values))
    if how == "truncated":
        text = _dumps(e)
        return text[: draw(st.integers(1, len(text) - 1))]
    if how == "not_utf8":
        text = _dumps(e)
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + text[at:]
    if how == "huge_int":
        return _dumps({**e, "step": 0}).replace(b'"step": 0', b'"step": ' + HUGE.encode())
    if how == "deep":
        return _dumps({**e, "x": 0}).replace(b'"x": 0', b'"x": ' + b"[" * DEEP + b"]" * DEEP)
    if how == "nested_ok":
        return _dumps({**e, "x": 0}).replace(b'"x": 0', b'"x": ' + b"[" * 30 + b"]" * 30)
    if how == "surrogate":
        return _dumps({**e, draw(st.sampled_from(["key", "fp"])): "\ud800"})
    if how == "nan_step":
        return _dumps({**e, "step": draw(st.sampled_from([math.nan, math.inf, 1.0]))})
    if how == "bad_leaf":
        leaf = {"fp": "p", "dtype": "float32", "shape": [1]}
        name = draw(st.sampled_from(["fp", "dtype", "shape", "v"]))
        return _dumps({**e, "t": [{**leaf, name: draw(json_values)}]})
    return draw(st.sampled_from([b"", b"  ", b"\t\r"]))


@st.composite
def events_files(draw: st.DrawFn) -> bytes:
    """An events file: lines, the last one perhaps torn (no newline: ignored, whatever it holds)."""
    body = b"".join(line + b"\n" for line in draw(st.lists(event_lines(), max_size=5)))
    if draw(st.booleans()):
        body += draw(event_lines())[:-1] or b"{"
    return body


VALID_ENV = Environment(
    torch_version="2.4.0", python_version="3.11.4", num_threads=4, hostname="alpha"
).to_dict()

#: Damaged JSON files: a record holding one as env.json or settings.json is damaged (exit 2).
JSON_FILE_DAMAGE = [
    b'{"seed": NaN}',
    b'{"a": -Infinity}',
    b'{"a": 1e999}',
    b'{"a": ' + HUGE.encode() + b"}",
    b'{"a": ' + b"[" * 150 + b"]" * 150 + b"}",
    b"[" * DEEP + b"]" * DEEP,
    b'{"a": "\\udc80"}',
    b'{"torch_version": "2.4',
    b"\xff\xfe{}",
    b"",
]
json_file_damage = st.sampled_from(JSON_FILE_DAMAGE)


@st.composite
def record_json_files(draw: st.DrawFn) -> tuple[bytes | None, bool]:
    """A record's env.json or settings.json: absent, well formed (of any shape), or damaged."""
    how = draw(st.sampled_from(["absent", "env", "any", "damaged"]))
    if how == "absent":
        return None, False
    if how == "env":
        env = {**VALID_ENV, "num_threads": draw(st.integers(1, 2)), "hostname": draw(st.text(max_size=4))}
        return _dumps(env), False
    if how == "any":  # well-formed JSON that is not an environment / settings: read, not an error
        return _dumps(draw(json_values)), False
    return draw(json_file_damage), True


# --- compare ---------------------------------------------------------------------------------------


def _emptied(directory: Path) -> Path:
    """``directory``, created or emptied (examples reuse directories: creating and removing
    hundreds of temporary directories is most of the run time on a slow disk)."""
    directory.mkdir(exist_ok=True)
    for child in directory.iterdir():
        child.unlink()
    return directory


def write_records(root: Path, *records: dict[str, tuple[bytes | None, bool]]) -> list[Path]:
    """Write each record (``{file name: (content or None, ...)}``) to ``root/a``, ``root/b``..."""
    paths = []
    for name, files in zip("ab", records, strict=False):
        path = _emptied(root / name)
        for file_name, (content, _) in files.items():
            if content is not None:
                (path / file_name).write_bytes(content)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for every example of a module's fuzz tests."""
    return tmp_path_factory.mktemp("fuzz")


def _expected_compare_error(
    root: Path, files: dict[str, tuple[bytes | None, bool]]
) -> tuple[Path, int | None] | None:
    """The first malformed file load_run meets in ``root`` (events in name order, env, settings)."""
    for name in sorted(n for n in files if n.startswith("events.")):
        content = files[name][0]
        assert content is not None
        for number, raw in enumerate(content.split(b"\n")[:-1], start=1):
            if line_status(raw) is False:
                return root / name, number
    for name in ("env.json", "settings.json"):
        if files[name][1]:
            return root / name, None
    return None


@st.composite
def records(draw: st.DrawFn) -> dict[str, tuple[bytes | None, bool]]:
    files: dict[str, tuple[bytes | None, bool]] = {"events.rank0.jsonl": (draw(events_files()), False)}
    if draw(st.booleans()):
        files["events.rank1.jsonl"] = (draw(events_files()), False)
    files["env.json"] = draw(record_json_files())
    files["settings.json"] = draw(record_json_files())
    return files


def check_compare(
    capsys: pytest.CaptureFixture[str], root: Path, rec_a: dict[str, Any], rec_b: dict[str, Any]
) -> int:
    a, b = write_records(root, rec_a, rec_b)
    expected = _expected_compare_error(a, rec_a) or _expected_compare_error(b, rec_b)
    code, out, err = run_cli(capsys, ["compare", str(a), str(b), "--json"])
    if expected is not None:
        assert_refused(code, out, err, "compare", *expected)
    else:
        data = assert_json_result(code, out, err)
        assert out.count("\n") == 1  # one line
        if code == 3:  # no difference, but nothing beyond init compared on some rank
            assert data["reproducible"] is None and data["inconclusive"] is True
            assert data["first_divergence"] is None and data["coverage"]["uncovered_ranks"]
        else:
            assert data["reproducible"] is (code == 0) and data["inconclusive"] is False
    human = run_cli(capsys, ["compare", str(a), str(b)])
    assert human[0] == code  # the rendering never fails where --json did not
    return code


@FUZZ
@given(records(), records())
def test_compare_of_fuzzed_records(
    capsys: pytest.CaptureFixture[str], scratch: Path, rec_a: dict[str, Any], rec_b: dict[str, Any]
) -> None:
    code = check_compare(capsys, scratch, rec_a, rec_b)
    event(f"exit {code}")  # --hypothesis-show-statistics: every outcome is reached


@FUZZ
@given(records(), st.data())
def test_compare_of_a_record_with_its_damaged_copy(
    capsys: pytest.CaptureFixture[str], scratch: Path, rec: dict[str, Any], data: st.DataObject
) -> None:
    # the same events on both sides (mostly identical runs, the path to exit 0) and one damaged line
    other = dict(rec)
    content = rec["events.rank0.jsonl"][0]
    lines = content.split(b"\n")
    at = data.draw(st.integers(0, len(lines) - 1))
    lines.insert(at, data.draw(event_lines()))
    other["events.rank0.jsonl"] = (b"\n".join(lines), False)
    event(f"identical copies: exit {check_compare(capsys, scratch, rec, rec)}")
    event(f"damaged copy: exit {check_compare(capsys, scratch, rec, other)}")


@FUZZ
@given(events_files(), st.lists(st.integers(1, 40), max_size=6))
def test_the_live_reader_agrees_with_read_events(scratch: Path, content: bytes, chunks: list[int]) -> None:
    """EventTail, fed the file in pieces as a running process writes it, reads what read_events
    reads from the whole file: the same events, or the same error (file, line, problem)."""
    path = _emptied(scratch / "tail") / "events.rank0.jsonl"
    path.write_bytes(b"")
    tail = EventTail(path)
    live_error = None
    written = 0
    with open(path, "ab") as f:
        for size in [*chunks, len(content)]:
            f.write(content[written : written + size])
            f.flush()
            written += size
            try:
                tail.poll()
            except EnvFileError as exc:
                live_error = str(exc)
                break
        f.write(content[written:])
    try:
        expected, error = read_events(path), None
    except EnvFileError as exc:
        expected, error = [], str(exc)
    assert live_error == error
    if error is None:
        tail.poll()
        assert json.dumps(tail.events) == json.dumps(expected)  # NaN compares equal as text
    else:
        with pytest.raises(EnvFileError) as info:  # sticky: never skips the bad line
            tail.poll()
        assert str(info.value) == error


GOOD = {"i": 0, "kind": "init", "key": "optimizer0", "step": 0, "fp": "a", "t": []}


def _good_record(fps: list[str]) -> dict[str, tuple[bytes | None, bool]]:
    lines = [GOOD] + [{**GOOD, "kind": "compute", "step": s, "fp": fp} for s, fp in enumerate(fps)]
    body = b"".join(_dumps(e) + b"\n" for e in lines)
    return {
        "events.rank0.jsonl": (body, False),
        "env.json": (_dumps(VALID_ENV), False),
        "settings.json": (None, False),
    }


def test_well_formed_records_still_compare(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Negative control: the fuzz harness accepts good records, with exit 0 and 1 as due."""
    assert check_compare(capsys, tmp_path, _good_record(["x", "y"]), _good_record(["x", "y"])) == 0
    assert check_compare(capsys, tmp_path, _good_record(["x", "y"]), _good_record(["x", "Y"])) == 1


@pytest.mark.parametrize(
    "line",
    [
        b"[1, 2]",
        b"{}",
        b'"init"',
        b'{"kind": "init", "key": "k", "step": "0", "fp": "a", "t": []}',
        b'{"kind": "init", "key": "k", "step": null, "fp": "a", "t": []}',
        b'{"kind": "init", "key": "k", "step": ' + HUGE.encode() + b', "fp": "a", "t": []}',
        b"[" * DEEP + b"]" * DEEP,
        b'{"kind": "init", "key": "\xff", "step": 0, "fp": "a", "t": []}',
        b'{"kind": "init", "key": "k", "step": 0, "fp": "a", "t": [{"fp": "a"}]}',
        b'{"kind": "init", "key": "k", "step": 0, "fp": "a", "t": []',
    ],
)
def test_each_kind_of_damaged_line_is_refused_naming_file_and_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, line: bytes
) -> None:
    assert line_status(line) is False  # the oracle agrees: the fuzz tests can see damage
    damaged = _good_record(["x", "y"])
    body = damaged["events.rank0.jsonl"][0]
    assert body is not None
    damaged["events.rank0.jsonl"] = (body + line + b"\n", False)
    a, b = write_records(tmp_path, _good_record(["x", "y"]), damaged)
    for flags in (["--json"], []):
        code, out, err = run_cli(capsys, ["compare", str(a), str(b), *flags])
        assert_refused(code, out, err, "compare", b / "events.rank0.jsonl", line=4)


def test_nan_and_infinity_in_recorded_values_give_strict_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    leaf = {"fp": "p", "dtype": "float32", "shape": [3], "v": [math.inf, 1.0, 0.0]}
    a, b = _good_record(["x"]), _good_record(["y"])
    for rec, v in ((a, [math.inf, 1.0, 0.0]), (b, [math.inf, 1.0, math.nan])):
        differs = "p" if v[2] == 0.0 else "q"
        step = {**GOOD, "kind": "compute", "fp": differs, "t": [{**leaf, "fp": differs, "v": v}]}
        rec["events.rank0.jsonl"] = (_dumps(GOOD) + b"\n" + _dumps(step) + b"\n", False)
    pa, pb = write_records(tmp_path, a, b)
    code, out, err = run_cli(capsys, ["compare", str(pa), str(pb), "--json"])
    tensor = assert_json_result(code, out, err)["tensor"]
    assert code == 1 and tensor["max_abs_diff"] is None and tensor["nonfinite"] is True
    code, out, _ = run_cli(capsys, ["compare", str(pa), str(pb)])
    assert "largest |a-b|: not finite" in out


def test_a_malformed_environment_in_a_record_is_named_in_a_note(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    a, b = _good_record(["x"]), _good_record(["y"])
    b["env.json"] = (_dumps({**VALID_ENV, "num_threads": "four"}), False)
    pa, pb = write_records(tmp_path, a, b)
    code, out, err = run_cli(capsys, ["compare", str(pa), str(pb), "--json"])
    data = assert_json_result(code, out, err)
    assert code == 1 and data["env_differences"] == []  # the verdict stands
    assert any(f"{pb / 'env.json'} is malformed" in n and "num_threads" in n for n in data["notes"])


# --- env diff -------------------------------------------------------------------------------------

#: known fields, and which values are of the wrong type for them (then the file is malformed)
WRONG_TYPES: dict[str, Callable[[Any], bool]] = {
    "torch_version": lambda v: not isinstance(v, str),
    "hostname": lambda v: not isinstance(v, str),
    "num_threads": lambda v: type(v) is not int,
    "git_dirty": lambda v: not isinstance(v, bool),
    "env_vars": lambda v: not isinstance(v, dict),
    "packages": lambda v: not isinstance(v, dict),
    "gpus": lambda v: not isinstance(v, list),
    "cpu_flags": lambda v: not isinstance(v, list),
}


@st.composite
def env_files(draw: st.DrawFn) -> tuple[bytes, bool]:
    """An environment file's bytes and whether it is malformed."""
    env = {**VALID_ENV, "hostname": draw(st.text(max_size=4)), "num_threads": draw(st.integers(1, 3))}
    how = draw(
        st.sampled_from(
            ["good", "nested", "nested", "extra", "extra", "wrong_type", "no_id", "any", "damaged"]
        )
    )
    malformed = False
    if how == "nested":  # wrong types *inside* well-formed fields: read, compared, never a crash
        env["env_vars"] = draw(st.dictionaries(st.text(max_size=4), json_values, max_size=3))
        env["packages"] = draw(st.dictionaries(st.text(max_size=4), json_values, max_size=3))
        env["gpus"] = draw(st.lists(json_values, max_size=3))
        env["torch_build"] = draw(st.dictionaries(st.text(max_size=4), json_values, max_size=3))
    elif how == "wrong_type":
        name = draw(st.sampled_from(sorted(WRONG_TYPES)))
        env[name] = draw(json_values.filter(lambda v: v is not None))
        malformed = WRONG_TYPES[name](env[name])
    elif how == "extra":  # fields of a newer version: kept and compared
        names = st.text(max_size=4).map(lambda k: "x_" + k)
        env.update(draw(st.dictionaries(names, json_values, max_size=3)))
    elif how == "no_id":
        env = {k: v for k, v in env.items() if k not in ("torch_version", "python_version", "collected_at")}
        malformed = True
    elif how == "any":  # random JSON: its keys (4 characters at most) never identify an environment
        return _dumps(draw(json_values)), True
    else:
        return draw(json_file_damage), True
    data: Any = {"env": env} if draw(st.booleans()) else env
    return _dumps(data), malformed


def check_env_diff(
    capsys: pytest.CaptureFixture[str],
    root: Path,
    file_a: tuple[bytes, bool],
    file_b: tuple[bytes, bool],
    *,
    as_dir: bool,
) -> int:
    """``env diff A B`` of two files (or run-record directories holding them as env.json)."""
    if as_dir:
        dirs = write_records(root, {"env.json": file_a}, {"env.json": file_b})
        paths, args = [d / "env.json" for d in dirs], [str(d) for d in dirs]
    else:
        directory = _emptied(root / "files")
        paths = [directory / "a.json", directory / "b.json"]
        for path, (content, _) in zip(paths, (file_a, file_b), strict=True):
            path.write_bytes(content)
        args = [str(p) for p in paths]
    code, out, err = run_cli(capsys, ["env", "diff", *args, "--json"])
    bad = [p for p, (_, malformed) in zip(paths, (file_a, file_b), strict=True) if malformed]
    if bad:  # load_env reads A first
        assert_refused(code, out, err, "env", bad[0])
    else:
        data = assert_json_result(code, out, err)
        assert set(data) == {"a", "b", "breaks", "differences"} and data["breaks"] is (code == 1)
    human = run_cli(capsys, ["env", "diff", *args])
    assert human[0] == code  # the rendering never fails where --json did not
    return code


@FUZZ
@given(env_files(), env_files(), st.booleans())
def test_env_diff_of_fuzzed_files(
    capsys: pytest.CaptureFixture[str],
    scratch: Path,
    file_a: tuple[bytes, bool],
    file_b: tuple[bytes, bool],
    as_dir: bool,
) -> None:
    event(f"exit {check_env_diff(capsys, scratch, file_a, file_b, as_dir=as_dir)}")


def test_well_formed_environments_still_diff(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Negative control: equal environments exit 0, a breaking difference exits 1."""
    good = (_dumps(VALID_ENV), False)
    assert check_env_diff(capsys, tmp_path, good, good, as_dir=False) == 0
    other = (_dumps({**VALID_ENV, "num_threads": 8}), False)
    assert check_env_diff(capsys, tmp_path, good, other, as_dir=True) == 1


@pytest.mark.parametrize("content", JSON_FILE_DAMAGE)
@pytest.mark.parametrize("as_dir", [False, True])
def test_each_kind_of_damaged_environment_is_refused_naming_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: bytes, as_dir: bool
) -> None:
    check_env_diff(capsys, tmp_path, (_dumps(VALID_ENV), False), (content, True), as_dir=as_dir)


@pytest.mark.parametrize(
    "extra",
    [
        {"x": math.nan},
        {"x": [math.inf]},
        {"x": "\udc80"},
        {"x": 10**5000},
        {"env_vars": {"A": "\ud800"}},
    ],
)
def test_an_environment_built_in_python_must_be_strict_json_too(extra: dict[str, Any]) -> None:
    with pytest.raises(EnvFileError, match="An environment must be strict JSON"):
        Environment.from_dict({**VALID_ENV, **extra})


def test_an_environment_nested_deeper_than_any_stack_is_refused_not_a_recursion_error() -> None:
    deep: Any = 1
    for _ in range(DEEP):
        deep = [deep]
    with pytest.raises(EnvFileError, match="nested deeper than 100 levels"):
        Environment.from_dict({**VALID_ENV, "x": deep})
    shallow: Any = 1
    for _ in range(99):  # the environment is level 1, the innermost list level 100: the limit
        shallow = [shallow]
    env = Environment.from_dict({**VALID_ENV, "x": shallow})  # the control: at the limit, read
    assert diff_env(env, env) == []
