"""Autouse guards for every test and doctest: restore, and assert nothing leaked.

- ``os.environ``: restored; a test that leaves it changed fails (use ``monkeypatch.setenv``).
- torch determinism flags and thread count: restored; a leak fails the test.
- global RNG states (Python, NumPy, torch CPU): restored; a leak fails the test unless it
  requests the ``rng_changes_ok`` fixture (doctests are allowed to change them).

Markers (declared in pyproject.toml):
- ``requires_cuda``: skipped, with the reason, where no CUDA device is visible; with
  ``--require-cuda`` (the GPU validation passes it) a missing device fails them instead.
- ``slow``: many subprocesses; ``make test`` runs them, ``make quick`` (``-m "not slow"``) does not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from torchrepro.flags import DeterminismFlags

# DeterminismFlags' fields that are environment variables: os.environ's check covers them.
_VARIABLES = {
    "cublas_workspace_config": "CUBLAS_WORKSPACE_CONFIG",
    "flash_attention_deterministic": "FLASH_ATTENTION_DETERMINISTIC",
}


def _flags() -> dict[str, Any]:
    # DeterminismFlags.capture() reads every switch torchrepro owns (the environment variables
    # are checked with os.environ); the rest are switches tests may touch that it does not own.
    flags = DeterminismFlags.capture()
    switches = {f.name: getattr(flags, f.name) for f in dataclasses.fields(flags)}
    for variable in _VARIABLES:
        del switches[variable]
    return {
        **switches,
        "mkldnn.enabled": torch.backends.mkldnn.enabled,
        "num_threads": torch.get_num_threads(),
    }


def _restore_flags(f: dict[str, Any]) -> None:
    switches = {k: v for k, v in f.items() if k not in ("mkldnn.enabled", "num_threads")}
    variables = {name: os.environ.get(env) for name, env in _VARIABLES.items()}
    DeterminismFlags(**switches, **variables).restore()
    torch.backends.mkldnn.enabled = f["mkldnn.enabled"]
    torch.set_num_threads(f["num_threads"])


def _rng() -> tuple[Any, ...]:
    return (random.getstate(), np.random.get_state(), torch.get_rng_state())


def _same_rng(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    np_same = a[1][0] == b[1][0] and bool((a[1][1] == b[1][1]).all()) and a[1][2:] == b[1][2:]
    return a[0] == b[0] and np_same and torch.equal(a[2], b[2])


# Written by torch itself: the first torch.use_deterministic_algorithms() call imports
# torch._inductor.config, which sets TORCHINDUCTOR_CACHE_DIR for its compile workers.
_ENV_SET_BY_TORCH = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _ENV_SET_BY_TORCH}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-cuda",
        action="store_true",
        help="fail the tests marked requires_cuda when no CUDA device is visible, instead of skipping them",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() or config.getoption("--require-cuda"):
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device (none is visible; --require-cuda makes this a failure)"
    )
    for item in items:
        if item.get_closest_marker("requires_cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def rng_changes_ok() -> None:
    """Request this fixture in a test that changes global RNG state on purpose."""


@pytest.fixture(autouse=True)
def _guard_global_state(request: pytest.FixtureRequest) -> Iterator[None]:
    env = _environ()
    flags = _flags()
    rng = _rng()
    yield
    problems = []
    env_now = _environ()
    if env_now != env:
        changed = sorted(k for k in set(env) | set(env_now) if env.get(k) != env_now.get(k))
        problems.append(f"os.environ changed: {changed}")
        for k in set(env_now) - set(env):
            del os.environ[k]
        os.environ.update(env)
    flags_now = _flags()
    if flags_now != flags:
        changed = sorted(k for k in flags if flags[k] != flags_now[k])
        problems.append(f"torch flags changed: {changed}")
        _restore_flags(flags)
    rng_allowed = "rng_changes_ok" in request.fixturenames or isinstance(request.node, pytest.DoctestItem)
    if not _same_rng(rng, _rng()):
        if not rng_allowed:
            problems.append("global RNG state changed (request `rng_changes_ok` if intended)")
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
    if problems:
        pytest.fail("test leaked global state: " + "; ".join(problems), pytrace=False)


# Scripts the tests run in subprocesses are not test modules: --doctest-modules must not import
# them (several exit or train at import time).
collect_ignore_glob = ["tests/*scripts/*.py"]

# The integrations import their framework; `make test` installs every framework, but a bare
# install of the package (without the extras) must still collect the doctests of the rest.
collect_ignore = [
    f"src/torchrepro/integrations/{module}.py"
    for module, framework in (("lightning", "lightning"), ("transformers", "transformers"))
    if importlib.util.find_spec(framework) is None
]
