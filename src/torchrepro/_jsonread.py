"""Strict JSON reading: what every reader of a file torchrepro wrote (or a user edited) accepts.

Strict JSON is what ``json_problem`` finds nothing wrong with: nesting of arrays and objects no
deeper than ``MAX_JSON_DEPTH``, every string and key Unicode text (no lone surrogate), no NaN or
infinity (unless a caller allows them: recorded values may be NaN), no integer beyond Python's digit
limit. So every value read here can be written back as strict JSON.

Invariants: ``parse_json`` raises nothing but a one-line ``ValueError`` saying what is wrong (not
UTF-8, not JSON, not strict JSON), and ``read_json`` nothing but an ``EnvFileError`` naming the
file; no input recurses without bound (arbitrarily deep input is refused, never a
``RecursionError``). The run record (``runrecord``) and the environment (``env``) read through this
module. No torch: the standard library and ``errors`` only.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import sys
from typing import Any

from torchrepro.errors import EnvFileError

__all__ = ["MAX_JSON_DEPTH", "is_text", "json_problem", "loads", "parse_json", "read_json"]

MAX_JSON_DEPTH = 100
"""The deepest nesting of arrays and objects a record or environment file may hold (torchrepro
writes at most 4 levels); deeper is malformed, so no reader ever recurses without bound."""


def _int(text: str) -> int:
    limit = _int_digit_limit()
    digits = len(text.lstrip("-"))
    if 0 < limit < digits:
        raise ValueError(f"an integer of {digits} digits (more than Python's limit of {limit})")
    return int(text)


def _int_digit_limit() -> int:
    """Python's limit on the digits of an int converted from or to text (0: none)."""
    get = getattr(sys, "get_int_max_str_digits", None)  # Python >= 3.10.7
    return int(get()) if get is not None else 0


def is_text(value: Any) -> bool:
    """A str that is Unicode text (a lone surrogate escape would break printing it)."""
    if not isinstance(value, str):
        return False
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_problem(value: Any, *, allow_nan: bool = False) -> str | None:
    """What keeps ``value`` (parsed JSON, or plain data to be written as JSON) from being strict
    JSON every reader here accepts; None when nothing does.

    Problems: nesting of arrays/objects deeper than ``MAX_JSON_DEPTH``; a string or key that is not
    Unicode text (a lone surrogate such as ``"\\ud800"``); NaN or an infinity (unless
    ``allow_nan``); an integer beyond Python's digit limit (it could not be written back). The walk
    is iterative, so arbitrarily deep input cannot exhaust the stack.
    """
    limit = _int_digit_limit()
    big = None if limit == 0 else 10**limit
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not is_text(item):
                return f"the string {reprlib.repr(item)} is not Unicode text (a lone surrogate)"
        elif isinstance(item, float):
            if not allow_nan and not math.isfinite(item):
                return f"{item} (NaN or an infinity) is not a JSON number"
        elif isinstance(item, int) and not isinstance(item, bool):
            if big is not None and not -big < item < big:
                return f"an integer of more than {limit} digits (Python's limit)"
        elif isinstance(item, (dict, list, tuple)):
            if depth > MAX_JSON_DEPTH:
                return f"nested deeper than {MAX_JSON_DEPTH} levels"
            if isinstance(item, dict):
                stack.extend((k, depth) for k in item)
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
    return None


def loads(text: str | bytes) -> Any:
    """``json.loads`` with every failure a one-line ``ValueError`` (NaN and infinities pass).

    Only the syntax, UTF-8 and the digit limit are checked, not ``json_problem``: the caller checks
    the rest (``parse_json``, or ``runrecord.validate_event`` for events, whose values may be NaN).
    """
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, parse_int=_int)
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ValueError(f"not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}" if exc.lineno > 1 else f"column {exc.colno}"
        raise ValueError(f"not valid JSON: {exc.msg} at {where}") from None
    except ValueError as exc:  # too many digits (``_int``)
        raise ValueError(f"not valid JSON: {exc}") from None


def parse_json(text: str | bytes, *, allow_nan: bool = False) -> Any:
    """Parse JSON strictly; ``ValueError`` (one line, saying what is wrong) when it is malformed:
    not UTF-8, not JSON, or not strict JSON (``json_problem``: NaN and infinities only with
    ``allow_nan``)."""
    value = loads(text)
    problem = json_problem(value, allow_nan=allow_nan)
    if problem is not None:
        raise ValueError(f"not valid JSON: {problem}")
    return value


def read_json(path: str | os.PathLike[str]) -> Any:
    """A JSON file's value; ``EnvFileError`` naming the file when it is unreadable or malformed
    (``parse_json``: strict, no NaN or infinity)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise EnvFileError(f"cannot read {os.fspath(path)}: {exc}") from None
    try:
        return parse_json(data)
    except ValueError as exc:
        raise EnvFileError(f"cannot read {os.fspath(path)}: {exc}") from None
