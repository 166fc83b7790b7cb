"""The docs tests' runner: every page runs in a child forked from the suite's warm process (snippets.PageRunner,
tests/warmkit.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import warmkit  # noqa: E402
from snippets import PageRunner  # noqa: E402


@pytest.fixture(scope="session")
def page_runner() -> Iterator[PageRunner]:
    runner = PageRunner(warmkit.shared())
    try:
        yield runner
    finally:
        runner.close()
