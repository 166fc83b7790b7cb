"""The base of every event (:mod:`events.schema` holds the vocabulary)."""

from __future__ import annotations

from typing import ClassVar

import msgspec

__all__ = ["Event"]


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", gc=False):
    """Base of every event. ``KIND`` is the stable kind name, ``VERSION`` its schema version."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
