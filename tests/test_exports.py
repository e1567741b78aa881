"""The public surface: __all__ sorted and complete, every public name documented, lean imports."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import torchrepro


def test_all_is_sorted_and_complete() -> None:
    assert torchrepro.__all__ == sorted(torchrepro.__all__)
    public = {n for n in dir(torchrepro) if not n.startswith("_")}
    modules = {n for n in public if inspect.ismodule(getattr(torchrepro, n))}
    assert set(torchrepro.__all__) - {"__version__"} == public - modules


def test_every_public_name_has_a_docstring() -> None:
    missing = [
        name
        for name in torchrepro.__all__
        if name != "__version__" and not (getattr(torchrepro, name).__doc__ or "").strip()
    ]
    assert missing == []


def test_import_loads_only_torch_numpy_and_stdlib() -> None:
    code = (
        "import sys, json; before = set(sys.modules); import torchrepro; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {m.split(".")[0] for m in json.loads(out.stdout)}
    stdlib = set(sys.stdlib_module_names)
    # torch's own imports (sympy, typing_extensions, ...) come with importing torch itself.
    torch_only = subprocess.run(
        [sys.executable, "-c", code.replace("torchrepro", "torch")],
        capture_output=True,
        text=True,
        check=True,
    )
    from_torch = {m.split(".")[0] for m in json.loads(torch_only.stdout)}
    extra = loaded - stdlib - from_torch - {"torch", "torchrepro", "numpy"}
    assert extra == set(), f"import torchrepro loaded unexpected modules: {sorted(extra)}"


def test_version_and_help_from_the_console() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torchrepro", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"torchrepro {torchrepro.__version__}"
    out = subprocess.run([sys.executable, "-m", "torchrepro", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("run", "check", "compare", "audit", "env"):
        assert command in out.stdout


def test_testing_is_a_lazy_submodule_with_a_documented_surface() -> None:
    """``torchrepro.testing.assert_reproducible`` works after a bare ``import torchrepro``, and
    ``torchrepro.testing`` lists its names like the face does."""
    code = (
        "import sys, json, torchrepro; before = set(sys.modules); t = torchrepro.testing; "
        "print(json.dumps([t.__name__, sorted(set(sys.modules) - before)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    name, loaded = json.loads(out.stdout)
    assert name == "torchrepro.testing"
    assert [m for m in loaded if m.startswith("torchrepro")] == ["torchrepro.testing"]  # no submodule yet
    import torchrepro.testing as testing

    assert (
        testing.__all__ == sorted(testing.__all__) == sorted(n for n in dir(testing) if not n.startswith("_"))
    )
    assert all((getattr(testing, n).__doc__ or "").strip() for n in testing.__all__)
    assert "testing" in dir(torchrepro) and "testing" not in torchrepro.__all__  # a module, not a name
