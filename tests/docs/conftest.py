"""The docs tests' shared warm process: every page runs in a child forked from it (snippets.PageRunner)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from snippets import PageRunner  # noqa: E402


@pytest.fixture(scope="session")
def page_runner() -> Iterator[PageRunner]:
    runner = PageRunner()
    try:
        yield runner
    finally:
        runner.close()
