"""The README is the front page (what torchrepro is, the two commands, a minute of quickstart, the
command line in a few lines, the guarantees, links into the site); the reference lives in the
documentation site, where every code block runs (``test_docs.py``). So the README:

- opens with the two commands a fresh machine needs, ``make demo`` and ``make test``;
- shows no code the site does not: each of its code blocks is a copy of a block of a docs page
  (the same info string, its lines in the same order), which the docs tests run, or require a
  reason not to;
- links only to what exists: a file of the checkout and, for a page of the site, its built page
  and the anchor in it;
- stays a front page, not a second manual.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from test_docs import DOCS, PAGES, Block, blocks, build_site, commands

from helpers import ROOT

README = ROOT / "README.md"
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MAX_LINES = 150


def readme_blocks() -> list[Block]:
    return blocks("../README.md")  # a path relative to docs/, as blocks() takes


def copied_from(block: Block, source: Block) -> bool:
    """Whether ``block``'s non-blank lines are lines of ``source``, in the same order."""
    rest = iter(source.code.split("\n"))
    return block.info == source.info and all(
        any(line == other for other in rest) for line in block.code.split("\n") if line.strip()
    )


def test_the_readme_opens_with_the_two_commands() -> None:
    first = readme_blocks()[0]
    assert first.line <= 10, f"README.md:{first.line}: the two commands must come first"
    assert [c.text.split("#")[0].strip() for c in commands(first)] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_every_readme_block_is_a_block_of_the_site() -> None:
    site = [b for page in PAGES for b in blocks(page)]
    found = readme_blocks()
    assert len(found) >= 3
    orphans = [f"README.md:{b.line}" for b in found if not any(copied_from(b, s) for s in site)]
    assert orphans == [], (
        f"code blocks of the README that no docs page holds (so nothing runs them): {orphans}; "
        "copy them from a page of docs/, or put them on one"
    )


def test_the_block_copy_rule_keeps_order_and_info() -> None:
    source = Block("x.md", 1, "python", "import a\n\nx = 1\ny = 2\n")
    assert copied_from(Block("README.md", 1, "python", "import a\ny = 2"), source)
    assert not copied_from(Block("README.md", 1, "python", "y = 2\nimport a"), source)
    assert not copied_from(Block("README.md", 1, "bash", "import a"), source)
    assert not copied_from(Block("README.md", 1, "python", "import b"), source)


def test_the_readme_links_resolve_into_the_checkout_and_the_site(tmp_path: Path) -> None:
    links = _LINK.findall(README.read_text())
    assert any(url.startswith("docs/") for url in links), "the README links into the site"
    site = tmp_path / "site"
    parsed = build_site(site)
    broken = []
    for url in links:
        parts = urlsplit(url)
        if parts.scheme or url.startswith("//"):
            continue
        target = (ROOT / unquote(parts.path)).resolve()
        if not target.exists():
            broken.append(f"{url} (no such file)")
            continue
        if not target.is_relative_to(DOCS) or target.suffix != ".md":
            if parts.fragment:
                broken.append(f"{url} (an anchor is checked only in a page of docs/)")
            continue
        page = site / target.relative_to(DOCS).with_suffix(".html")
        if page not in parsed:
            broken.append(f"{url} (not a page of the built site)")
        elif parts.fragment and parts.fragment not in parsed[page].ids:
            broken.append(f"{url} (no such anchor)")
    assert broken == []


def test_the_readme_stays_a_front_page() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines (at most {MAX_LINES}): the reference belongs in a page of docs/, "
        "where its code runs; link to it from the README"
    )
