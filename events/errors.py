"""The root of nnx_es's error hierarchy and the errors of the event layer.

Every error the library raises derives from :class:`NnxError` and also from
the built-in exception it refines, so callers may catch either
(``except NnxError`` or ``except ValueError``).
"""

from __future__ import annotations

__all__ = [
    "CorruptEventError",
    "EventLogError",
    "LogClosedError",
    "NnxError",
    "SequenceGapError",
]


class NnxError(Exception):
    """Root of every error raised by nnx_es, events and projections."""


class EventLogError(NnxError, OSError):
    """The event log could not be opened, read or written."""


class LogClosedError(EventLogError):
    """An operation was attempted on a closed event log."""


class CorruptEventError(NnxError, ValueError):
    """A stored value does not decode to a known event.

    Attributes:
        seq: the sequence number (0-based) of the value, or ``None`` when the
            payload was decoded outside a log.
        reason: what was wrong with it.
    """

    def __init__(self, seq: int | None, reason: str) -> None:
        where = f"event at seq {seq}" if seq is not None else "event payload"
        super().__init__(f"{where} does not decode: {reason}")
        self.seq = seq
        self.reason = reason


class SequenceGapError(NnxError, ValueError):
    """The log's sequence numbers are not contiguous from 0."""

    def __init__(self, expected: int, found: int) -> None:
        super().__init__(f"sequence gap: expected seq {expected}, found seq {found}")
        self.expected = expected
        self.found = found
