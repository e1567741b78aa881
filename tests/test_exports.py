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
