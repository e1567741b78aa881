"""The documentation site (``mkdocs.yml``, ``docs/``): it builds with ``mkdocs build --strict``,
needs no network to be read, has no broken link, and every code block of every page runs.

How a page's code blocks are checked (the convention the pages follow):

- ```` ```python ````: the page's Python blocks run in order, in one fresh process in a temporary
  working directory (a copy of ``examples/`` beside them), so a later block uses an earlier
  block's names. The script puts each block at its line of the page, so a traceback names the
  page's line.
- ```` ```python ```` preceded by ``<!-- file: NAME -->``: the block is the file ``NAME``, written
  to the working directory for the shell blocks of the page that run it (one must).
- ```` ```bash ````: each line is a command starting with ``torchrepro`` or ``python`` (``\\``
  continues a line); they run after the page's Python blocks, in the same directory, and must exit
  0, or the code a ``# exit N`` comment on the line gives.
- ```` ```text ```` and ```` ```json ````: output or data, not commands; never run.
- Any ``python`` or ``bash`` block that cannot run here (it installs packages, needs a GPU) is
  preceded by ``<!-- not run: REASON -->``: the reason is required, and nothing else is skipped.
"""

from __future__ import annotations

import html.parser
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from helpers import ROOT, SRC, user_env

DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
RUN = {"python", "bash"}
NOT_CODE = {"text": "output or a diagram", "json": "output or data"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`\s]*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*(?P<what>not run|file):\s*(?P<value>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # the line of the block's first code line in the page (1-based)
    info: str
    code: str
    not_run: str | None = None  # the reason given by `<!-- not run: REASON -->`
    file: str | None = None  # the file name given by `<!-- file: NAME -->`

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of ``docs/<page>``, with the marker on the line before each."""
    lines = (DOCS / page).read_text().split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = m["indent"], i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(previous)
        code = "\n".join(line[len(indent) :] for line in lines[start:end])
        found.append(
            Block(
                page,
                start + 1,
                m["info"],
                code,
                not_run=mark["value"] if mark and mark["what"] == "not run" else None,
                file=mark["value"] if mark and mark["what"] == "file" else None,
            )
        )
        i = end + 1
    return found


@dataclass(frozen=True)
class Command:
    line: int
    text: str
    exit_code: int


def commands(block: Block) -> list[Command]:
    """The commands of a ``bash`` block, each with the exit code its ``# exit N`` comment expects."""
    out: list[Command] = []
    pending, first = "", 0
    for offset, raw in enumerate(block.code.split("\n")):
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            first = block.line + offset
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text, pending = pending + line, ""
        m = re.search(r"#\s*exit (\d+)", text)
        out.append(Command(first, text, int(m.group(1)) if m else 0))
    return out


def problems(block: Block) -> list[str]:
    """Why ``block`` breaks the convention (none when it is run, or marked with a reason)."""
    if block.info in NOT_CODE:
        return [f"{block.where}: a {block.info} block cannot be marked"] if block.not_run else []
    if block.info not in RUN:
        known = ", ".join(sorted(RUN | set(NOT_CODE)))
        return [f"{block.where}: info string {block.info!r}: use one of {known}"]
    if block.not_run is not None:
        return [] if block.not_run else [f"{block.where}: `not run` needs a reason"]
    if block.file is not None:
        return [] if block.info == "python" else [f"{block.where}: only a python block can be a file"]
    if block.info == "bash":
        return [
            f"docs/{block.page}:{c.line}: `{c.text}` is not a torchrepro or python command: mark the "
            "block `<!-- not run: REASON -->` or run the command"
            for c in commands(block)
            if c.text.split()[0] not in ("torchrepro", "python")
        ]
    return []


def test_every_code_block_is_run_or_marked_with_a_reason() -> None:
    found = [b for page in PAGES for b in blocks(page)]
    assert found, "no code block found in docs/"
    assert [p for b in found for p in problems(b)] == []


def test_the_block_parser_reads_markers_fences_and_exit_codes(tmp_path: Path) -> None:
    block = Block("x.md", 3, "bash", "# a comment\ntorchrepro check a.py  # exit 1\npython \\\n  b.py\n")
    assert commands(block) == [
        Command(4, "torchrepro check a.py  # exit 1", 1),
        Command(5, "python    b.py", 0),
    ]
    assert problems(Block("x.md", 1, "bash", "pip install x")) != []
    assert problems(Block("x.md", 1, "bash", "pip install x", not_run="needs the network")) == []
    assert problems(Block("x.md", 1, "bash", "pip install x", not_run="")) != []
    assert problems(Block("x.md", 1, "", "x = 1")) != []
    assert problems(Block("x.md", 1, "text", "anything")) == []


def _python_script(page: str, code_blocks: list[Block]) -> str:
    """The page's Python blocks as one script, each block at its own line of the page."""
    lines: list[str] = []
    for b in code_blocks:
        lines += [""] * (b.line - 1 - len(lines))
        lines += b.code.split("\n")
    return "\n".join(lines) + "\n"


def _shims(bin_dir: Path) -> None:
    """``torchrepro`` and ``python`` on PATH: this interpreter, running this checkout's code."""
    bin_dir.mkdir()
    for name, run in (("torchrepro", f'"{sys.executable}" -m torchrepro'), ("python", f'"{sys.executable}"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {run} "$@"\n')
        (bin_dir / name).chmod(0o755)


RUNNABLE = [p for p in PAGES if any(b.info in RUN and b.not_run is None for b in blocks(p))]
FRAMEWORK_PAGES = [p for p in RUNNABLE if p.startswith("frameworks/")]  # test_docs_frameworks.py


@pytest.mark.parametrize("page", [p for p in RUNNABLE if p not in FRAMEWORK_PAGES])
def test_the_code_of_every_page_runs(page: str, tmp_path: Path) -> None:
    run_page(page, tmp_path)


def run_page(page: str, tmp_path: Path) -> None:
    """Run the code blocks of ``docs/<page>`` as the module docstring says."""
    page_blocks = [b for b in blocks(page) if b.info in RUN and b.not_run is None]
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples", work / "examples")
    _shims(tmp_path / "bin")
    env = user_env(drop=("PYTHONHASHSEED",), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    run: list[str] = []
    for b in page_blocks:
        if b.file is not None:
            (work / b.file).write_text(b.code + "\n")
    python = [b for b in page_blocks if b.info == "python" and b.file is None]
    if python:
        name = "page_" + re.sub(r"\W", "_", page.removesuffix(".md")) + ".py"
        (work / name).write_text(_python_script(page, python))
        proc = subprocess.run(
            [sys.executable, name], cwd=work, env=env, capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, (
            f"the python blocks of docs/{page} failed (line numbers are the page's):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    for b in page_blocks:
        if b.info != "bash":
            continue
        for c in commands(b):
            run.append(c.text)
            proc = subprocess.run(
                ["bash", "-c", c.text], cwd=work, env=env, capture_output=True, text=True, timeout=240
            )
            assert proc.returncode == c.exit_code, (
                f"docs/{page}:{c.line}: `{c.text}` exited {proc.returncode}, the page says "
                f"{c.exit_code}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
    users = run + [b.code for b in page_blocks]  # a file is run by a command, or by another file
    unused = [
        b.where
        for b in page_blocks
        if b.file is not None and not any(b.file in u for u in users if u != b.code)
    ]
    assert unused == [], f"file blocks that no command of the page runs: {unused}"


class _Links(html.parser.HTMLParser):
    """The ids, links and external resources of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(str(a["id"]))
        if tag == "a" and a.get("name"):
            self.ids.add(str(a["name"]))
        url = a.get("href") if tag in ("a", "link") else a.get("src")
        if not url:
            return
        parts = urlsplit(url)
        if parts.scheme or url.startswith("//"):
            if tag != "a":  # a stylesheet, script, image or font loaded from the network
                self.external.append(url)
        else:
            self.links.append(url)


def build_site(site: Path) -> dict[Path, _Links]:
    """Build the site strictly into ``site`` (no warning allowed); every HTML page, parsed."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    parsed: dict[Path, _Links] = {}
    for page in site.rglob("*.html"):  # 404.html links from the server root, for any path
        parsed[page] = _Links()
        parsed[page].feed(page.read_text())
    return parsed


def test_the_site_builds_strictly_offline_without_broken_links(tmp_path: Path) -> None:
    site = tmp_path / "site"
    parsed = build_site(site)
    broken, external = [], []
    for page, links in parsed.items():
        if page.name == "404.html":
            continue
        external += [f"{page.relative_to(site)}: {url}" for url in links.external]
        for url in links.links:
            parts = urlsplit(url)
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {url} (no such file)")
            elif parts.fragment and target.suffix == ".html" and parts.fragment not in parsed[target].ids:
                broken.append(f"{page.relative_to(site)}: {url} (no such anchor)")
    assert broken == []
    assert external == [], "the site must read offline: nothing loaded from the network"
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*.py")) == []


def test_every_public_name_has_an_api_entry() -> None:
    import torchrepro

    text = (DOCS / "api" / "torchrepro.md").read_text()
    entries = set(re.findall(r"^::: torchrepro\.(\w+)\s*$", text, re.M))
    assert sorted(set(torchrepro.__all__) - entries) == []


def test_the_griffe_extension_fences_doctests_and_drops_roles() -> None:
    sys.path.insert(0, str(DOCS))
    try:
        from griffe_rst import markdown
    finally:
        sys.path.remove(str(DOCS))
    text = "See :meth:`state_dict`.\n\n    >>> f()\n    [[1, 2]]\n\nafter"
    assert markdown(text) == textwrap.dedent(
        """\
        See `state_dict`.

            ```pycon
            >>> f()
            [[1, 2]]
            ```

        after"""
    )
