"""A Griffe extension for the API pages: torchrepro's docstrings are written for ``help()`` and
doctest (reST roles, ``>>>`` examples); this turns them into Markdown the pages render.

- ``:meth:`state_dict``` (any ``:role:``) becomes the code span ```state_dict```;
- a doctest block (``>>>`` lines and their output, up to a blank line) becomes a ``pycon`` fence.

It changes only what the site shows, never the source.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def markdown(text: str) -> str:
    """``text`` (a docstring) with reST roles as code spans and doctest blocks fenced."""
    out: list[str] = []
    lines = _ROLE.sub(r"`\1`", text).split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out.append(f"{indent}```")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class DocstringsAsMarkdown(griffe.Extension):
    """Rewrites every docstring with :func:`markdown` as Griffe loads it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
