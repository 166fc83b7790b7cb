"""Every Python and shell block of README.md and of every page under docs/ runs as written.

The pages are found (``snippets.pages``), not listed, so a page another change adds is run too;
the convention is in docs/contributing.md and ``snippets``'s docstring. One test per page: its
blocks build on each other. The runner itself is tested in test_snippet_runner.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from snippets import REPO, blocks, pages

PAGES = pages()


def _runnable(page: Path) -> bool:
    return any(b.runs or b.file is not None for b in blocks(page))


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=lambda p: str(p.relative_to(REPO)))
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path, page_runner) -> None:
    page_runner.check(page, tmp_path / "page")


def test_every_page_is_well_formed_and_every_skip_says_why() -> None:
    """Parsing refuses an unclosed fence and a skip without a reason; a page with no block is fine."""
    assert REPO / "README.md" in PAGES and REPO / "docs" / "getting-started.md" in PAGES
    for page in PAGES:
        for block in blocks(page):
            assert block.skip is None or len(block.skip) > 10, f"{block.where}: say why it is skipped"
