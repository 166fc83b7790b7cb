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


#: tests that share one xdist worker under ``pytest -n 2 --dist loadgroup`` (``make test``), by node id prefix:
#: the torchrun tests one launch at a time (two 2-rank launches side by side would put four ranks on the two
#: cores and stretch their process-group timeouts), and the site's tests one build for all
XDIST_GROUPS = (("tests/distributed/", "torchrun"), ("tests/docs/test_site.py::", "docs-site"))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` grouped by :data:`XDIST_GROUPS`. xdist (3.8) groups by an ``@group`` suffix its workers
    put on ``item._nodeid`` from ``xdist_group`` marks, which pytest 9 no longer reads (its node id is ``_id``): the
    marks grouped nothing, so two torchrun launches overlapped and the site was built on both workers. The
    scheduler here takes the group from the node id itself, which every pytest gives it."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class PathGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((group for prefix, group in XDIST_GROUPS if nodeid.startswith(prefix)),
                        None) or super()._split_scope(nodeid)

    return PathGroups(config, log)
