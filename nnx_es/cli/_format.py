r"""How the command-line tools render what they read: a field value in one line (floats to 6 significant
digits, structs inline), and every string from a log made safe for a terminal.

A log, a run directory's name, a spec are someone else's bytes: a callback named
``"\x1b]0;title\x07\x1b[2J"`` printed raw sets the terminal's title and clears its screen.
:func:`printable` is the one escape every printer of the tools applies to text (table rows, summary
lines, error messages); :func:`json_line` is the JSON they print, with the characters JSON leaves raw
escaped as ``\uXXXX`` (the same string once decoded).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import msgspec

__all__ = ["fields", "fmt", "json_line", "printable"]

#: code points a terminal acts on rather than shows: the C0 and C1 controls and DEL, the line and
#: paragraph separators, and the bidirectional controls (text shown in another order than stored)
_CONTROLS = (*range(0x20), *range(0x7F, 0xA0), 0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F),
             *range(0x2066, 0x206A))
_ESCAPES = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _CONTROLS}
#: in JSON text: what msgspec leaves raw (it escapes U+0000..U+001F itself)
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in _CONTROLS if c >= 0x20}


def printable(text: str) -> str:
    """``text`` with every control character (:data:`_CONTROLS`) written as an escape (``\\x1b``,
    ``\\u202e``), so printing it shows it and does nothing else; other text is unchanged."""
    return text if text.isprintable() else text.translate(_ESCAPES)


def json_line(obj: Any) -> str:
    """``obj`` as one line of JSON (msgspec), a terminal's controls escaped as ``\\uXXXX`` (decodes the same)."""
    return msgspec.json.encode(obj).decode().translate(_JSON_ESCAPES)


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
        return "{" + ", ".join(_shown([f"{fmt(k) if isinstance(k, str) else k}: {fmt(v)}"
                                       for k, v in _ends(list(value.items()))], len(value))) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown([fmt(v) for v in _ends(list(value))], len(value))) + "]"
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a SHA-256 name
    return str(value)


#: a map or list longer than this prints its first and last entries and how many lie between (a long
#: run's stored checkpoints: thousands of entries on one line); --json prints every one
MAX_SHOWN = 8
_HEAD, _TAIL = 4, 2


def _ends(items: list[Any]) -> list[Any]:
    """``items``, or its first and last few when there are more than :data:`MAX_SHOWN`."""
    return items if len(items) <= MAX_SHOWN else items[:_HEAD] + items[-_TAIL:]


def _shown(rendered: list[str], total: int) -> list[str]:
    """The rendered entries of :func:`_ends`, with "... N more ..." between the first and last few."""
    if total <= MAX_SHOWN:
        return rendered
    return rendered[:_HEAD] + [f"... {total - _HEAD - _TAIL} more ({total} in all; --json prints every one) ..."] \
        + rendered[_HEAD:]


def fields(struct: msgspec.Struct) -> Iterator[tuple[str, Any]]:
    """Non-default fields of ``struct``, in declaration order."""
    for name, default in _defaults(type(struct)):
        value = getattr(struct, name)
        if default is _REQUIRED or value != default:
            yield name, value


_REQUIRED = object()


@functools.lru_cache(maxsize=None)
def _defaults(t: type) -> tuple[tuple[str, Any], ...]:
    """``(name, default)`` of each field of struct type ``t`` (:data:`_REQUIRED` for a required one), computed
    once per type: ``msgspec.structs.fields`` evaluates the annotations at each call (milliseconds)."""
    out = []
    for f in msgspec.structs.fields(t):
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = _REQUIRED
        out.append((f.name, default))
    return tuple(out)
