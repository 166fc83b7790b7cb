"""Shared test setup: import path and a generic builder of sample events.

The repository is not necessarily installed in the virtualenv, so the repo
root is put on ``sys.path`` (once). Test directories have no ``__init__.py``:
a test directory named ``events``/``projections``/``nnx_es`` is then never a
regular package and cannot shadow the real one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
_TESTS = str(Path(__file__).resolve().parent)
_FAULTS = str(Path(__file__).resolve().parent / "faults")
for _p in (_ROOT, _TESTS, _FAULTS):  # the repo's packages, and shared test helpers (trainkit, crashkit, ...)
    if _p not in sys.path:
        sys.path.insert(0, _p)


@pytest.fixture(scope="session")
def sample_events() -> dict[type, Any]:
    """One fully populated instance of every decodable event type (today's and legacy)."""
    from events import EVENT_TYPES
    from samplekit import sample_instance

    return {t: sample_instance(t) for t in EVENT_TYPES}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The warm process of tests/warmkit.py ends with the session that started it (if it did)."""
    if "warmkit" in sys.modules:
        sys.modules["warmkit"].close_shared()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n 2 --dist loadgroup`` (``make test``) the torchrun tests run on one worker, one
    launch at a time: two 2-rank launches side by side would put four ranks on the two cores and stretch
    their process-group timeouts."""
    for item in items:
        if "distributed" in item.keywords or Path(str(item.fspath)).parent.name == "distributed":
            item.add_marker(pytest.mark.xdist_group("torchrun"))
