"""What a team adopting the package gets: the license text the metadata names, classifiers and
project URLs, and an sdist without the CI scripts or local records. The Python versions the
classifiers claim are the ones the tests run on: CI (``.ci/run`` -> ``make test``) runs one
interpreter, and a version no test run uses is not claimed."""

from __future__ import annotations

import sys
from pathlib import Path

# tomllib is in the standard library from Python 3.11; the package supports 3.10, where
# ``import tomllib`` failed the collection of the whole suite. There pytest itself depends on tomli,
# the same parser under its old name.
if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_license_file_ships_and_matches_the_metadata() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_metadata_has_classifiers_urls_and_extras() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(c.startswith("Programming Language :: Python :: 3.1") for c in meta["classifiers"])
    assert "Typing :: Typed" in meta["classifiers"] and (ROOT / "src/torchrepro/py.typed").exists()
    assert {"Homepage", "Documentation", "Issues"} <= set(meta["urls"])
    extras = set(meta["optional-dependencies"])
    assert {"lightning", "transformers", "accelerate", "datasets", "parquet", "numpy"} <= extras


def test_the_classifiers_claim_exactly_the_python_the_tests_run_on() -> None:
    """A ``Programming Language :: Python :: 3.X`` classifier is a claim that 3.X is tested: the
    claimed versions are this test run's interpreter, and the floor is ``requires-python``'s."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    prefix = "Programming Language :: Python :: "
    claimed = {c.removeprefix(prefix) for c in meta["classifiers"] if c.startswith(prefix + "3.")}
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert claimed == {running}, (
        f"pyproject.toml claims Python {sorted(claimed)} in its classifiers, but the tests run on "
        f"{running} only: claim the versions CI runs (and add an interpreter to CI before claiming it)"
    )
    floor = meta["requires-python"].removeprefix(">=")
    assert tuple(map(int, floor.split("."))) <= sys.version_info[:2], meta["requires-python"]


def test_sdist_leaves_out_ci_and_local_records() -> None:
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]
    assert {".ci", ".torchrepro"} <= set(build["sdist"]["exclude"])
