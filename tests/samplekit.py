"""Sample events for the tests: a non-default instance of any event struct (``sample_instance``).

A module of its own (not ``conftest``): a test that imports it by name cannot pick up another
directory's ``conftest.py`` (tests/docs has one)."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["sample_instance"]


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
