"""The one frame walker (``torchrepro._frames``): op tracing and the child's hooks and probe
(``user_site``) name the same line."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from helpers import marked_line
from torchrepro._frames import Walker, user_site
from torchrepro.tracing.sites import Sites

HERE = Path(__file__)


def _line(marker: str) -> str:
    """``file:line`` of the line ending with ``# marker``, as a recorder shows it (relative to cwd)."""
    return f"{os.path.relpath(HERE, os.getcwd())}:{marked_line(HERE, marker)}"


@pytest.fixture
def framework(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A function of a loaded 'accelerate' package (a stand-in: its files lie in tmp_path) that
    calls back with its own frame, as Lightning's loop calls a user's ``training_step``."""
    package = tmp_path / "accelerate"
    package.mkdir()
    fake = types.ModuleType("accelerate")
    fake.__file__ = str(package / "__init__.py")
    monkeypatch.setitem(sys.modules, "accelerate", fake)
    source = "import sys\ndef run(callback):\n    return callback(sys._getframe())\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, str(package / "loop.py"), "exec"), namespace)
    return namespace["run"]


def test_tracing_and_the_hooks_name_the_same_user_line_through_a_framework(framework: Any) -> None:
    # one stack (the framework's frame, called from this test's line), shown to both users
    traced, hooked = framework(lambda frame: (Sites().user_location(frame), user_site(frame)))  # fit
    assert traced == (_line("fit"), False)  # was the framework's own line, accelerate/loop.py:3
    assert hooked == (_line("fit"), "accelerate")


def test_the_framework_skip_is_a_parameter(framework: Any) -> None:
    kept = framework(lambda frame: Walker(skip_frameworks=False).walk(frame)[0])
    assert kept is not None and kept.endswith(os.path.join("accelerate", "loop.py") + ":3")
    skipped = framework(lambda frame: Walker().walk(frame)[:2])  # skipped-call
    assert skipped == (_line("skipped-call"), "accelerate")


def test_user_frame_and_is_user_stop_at_the_users_code() -> None:
    import json

    from torchrepro._frames import is_user, user_frame

    here = sys._getframe()
    assert is_user(here) and user_frame(here) is here
    seen: list[Any] = []

    def hook(obj: Any) -> Any:  # called by the standard library's json decoder
        caller = sys._getframe(1)
        seen.append((is_user(caller), user_frame(caller)))
        return obj

    json.loads("{}", object_hook=hook)
    assert seen == [(False, here)]
