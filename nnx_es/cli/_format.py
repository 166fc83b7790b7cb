"""How ``inspect`` renders a field value in one line: floats to 6 significant digits, structs inline."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import msgspec

__all__ = ["fields", "fmt"]


def fmt(value: Any) -> str:
    """A compact rendering of a field value (floats to 6 significant digits, structs inline)."""
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "null"
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else repr(value)
    if isinstance(value, msgspec.Struct):
        shown = list(fields(value)) or [(f.name, getattr(value, f.name)) for f in msgspec.structs.fields(value)]
        return "(" + " ".join(f"{k}={fmt(v)}" for k, v in shown) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a SHA-256 name
    return str(value)


def fields(struct: msgspec.Struct) -> Iterator[tuple[str, Any]]:
    """Non-default fields of ``struct``, in declaration order."""
    for f in msgspec.structs.fields(struct):
        value = getattr(struct, f.name)
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            yield f.name, value  # required
            continue
        if value != default:
            yield f.name, value
