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

import msgspec
import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
_TESTS = str(Path(__file__).resolve().parent)
_FAULTS = str(Path(__file__).resolve().parent / "faults")
for _p in (_ROOT, _TESTS, _FAULTS):  # the repo's packages, and shared test helpers (trainkit, crashkit, ...)
    if _p not in sys.path:
        sys.path.insert(0, _p)


def _sample_value(t: msgspec.inspect.Type, salt: int) -> Any:
    """A non-default value of type ``t`` (``salt`` varies it between fields)."""
    mi = msgspec.inspect
    match t:
        case mi.UnionType(types=types):
            return _sample_value(next(x for x in types if not isinstance(x, mi.NoneType)), salt)
        case mi.BoolType():
            return True
        case mi.IntType():
            return 3 + salt
        case mi.FloatType():
            return 0.25 + salt
        case mi.StrType():
            return f"s{salt}"
        case mi.BytesType():
            return bytes([salt % 256, 1, 2])
        case mi.ListType(item_type=item):
            return [_sample_value(item, salt), _sample_value(item, salt + 1)]
        case mi.DictType(value_type=value):
            return {f"k{salt}": _sample_value(value, salt), f"k{salt + 1}": _sample_value(value, salt + 1)}
        case mi.AnyType():
            return {"nested": [1, "two", 3.5, None, True]}
        case mi.StructType(cls=cls):
            return sample_instance(cls, salt)
    raise TypeError(f"no sample value for {t!r}")


def sample_instance(cls: type, salt: int = 0) -> Any:
    """An instance of the Struct ``cls`` with every field (defaulted ones too) set to a non-default value."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    kwargs = {f.name: _sample_value(f.type, salt + i) for i, f in enumerate(info.fields)}
    return cls(**kwargs)


@pytest.fixture(scope="session")
def sample_events() -> dict[type, Any]:
    """One fully populated instance of every decodable event type (today's and legacy)."""
    from events import EVENT_TYPES

    return {t: sample_instance(t) for t in EVENT_TYPES}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n 2 --dist loadgroup`` (``make test``) the torchrun tests run on one worker, one
    launch at a time: two 2-rank launches side by side would put four ranks on the two cores and stretch
    their process-group timeouts."""
    for item in items:
        if "distributed" in item.keywords or Path(str(item.fspath)).parent.name == "distributed":
            item.add_marker(pytest.mark.xdist_group("torchrun"))
