"""Every test here launches torchrun (2 processes, gloo, CPU): marked ``distributed`` (select
them with ``-m distributed``, leave them out with ``-m "not distributed"``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().parent == Path(_HERE):
            item.add_marker(pytest.mark.distributed)
