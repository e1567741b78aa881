"""The code blocks of the framework pages (``docs/frameworks/``) run: the convention and the runner
are ``test_docs.py``'s; a module of their own so that ``pytest -n 2 --dist loadfile`` runs them
beside the other pages."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_docs import FRAMEWORK_PAGES, run_page


@pytest.mark.parametrize("page", FRAMEWORK_PAGES)
def test_the_code_of_every_framework_page_runs(page: str, tmp_path: Path) -> None:
    run_page(page, tmp_path)
