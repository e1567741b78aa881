"""``_imports.when_imported``: a function runs once a module is imported, and the hook never imports
it, never changes what the import gives, and never breaks it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _run(tmp_path: Path, code: str) -> list[str]:
    (tmp_path / "later_mod.py").write_text("VALUE = 41\n", encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        env={
            "PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[1] / 'src'}",
            "PATH": "/usr/bin:/bin",
        },
    )
    return [*out.stdout.split(), "|", *out.stderr.split()]


def test_the_hook_runs_after_the_import_and_never_imports(tmp_path: Path) -> None:
    got = _run(
        tmp_path,
        """
        import sys
        from torchrepro._imports import when_imported
        seen = []
        when_imported("later_mod", lambda m: (seen.append(m.VALUE), setattr(m, "VALUE", m.VALUE + 1)))
        print("later_mod" in sys.modules, seen)
        import later_mod
        print(later_mod.VALUE, seen, later_mod.__loader__.__class__.__name__)
        when_imported("later_mod", lambda m: seen.append("now"))
        print(seen)
        """,
    )
    assert got[:6] == ["False", "[]", "42", "[41]", "SourceFileLoader", "[41,"]


def test_a_failing_hook_is_reported_and_the_import_still_works(tmp_path: Path) -> None:
    got = _run(
        tmp_path,
        """
        from torchrepro._imports import when_imported
        when_imported("later_mod", lambda m: 1 / 0)
        import later_mod
        print(later_mod.VALUE)
        """,
    )
    assert got[0] == "41" and "ZeroDivisionError('division" in " ".join(got)


@pytest.mark.parametrize("name", ["no_such_module_anywhere", "later_mod.sub"])
def test_a_module_that_does_not_exist_still_fails_to_import(tmp_path: Path, name: str) -> None:
    got = _run(
        tmp_path,
        f"""
        from torchrepro._imports import when_imported
        when_imported({name!r}, print)
        try:
            import {name}
        except ImportError as exc:
            print(type(exc).__name__)
        """,
    )
    assert got[0] == "ModuleNotFoundError"
