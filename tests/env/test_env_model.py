"""Environment: its JSON form round-trips, and files of older and newer versions load."""

from __future__ import annotations

import dataclasses
import json

import pytest

from torchrepro import Environment, collect_env, diff_env


@pytest.fixture(scope="module")
def env() -> Environment:
    return collect_env()


def test_to_dict_is_json_and_round_trips(env: Environment) -> None:
    data = json.loads(json.dumps(env.to_dict()))
    again = Environment.from_dict(data)
    assert again == env
    assert diff_env(env, again) == []


def test_older_and_newer_files_load() -> None:
    old = Environment.from_dict({"torch_version": "2.4.0", "python_version": "3.10.1"})
    assert old.num_threads is None and old.extra == {}
    newer = Environment.from_dict({"torch_version": "2.4.0", "future_field": {"x": 1}})
    assert newer.extra == {"future_field": {"x": 1}}
    assert newer.to_dict()["future_field"] == {"x": 1}
    (d,) = diff_env(old, dataclasses.replace(old, extra={"future_field": 1}))
    assert (d.key, d.breaks) == ("future_field", False)
