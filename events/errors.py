"""The root of nnx_es's error hierarchy and the errors of the event layer.

Every error the library raises derives from :class:`NnxError` and also from
the built-in exception it refines, so callers may catch either
(``except NnxError`` or ``except ValueError``).
"""

from __future__ import annotations

__all__ = [
    "CorruptEventError",
    "DamagedLogError",
    "EventLogError",
    "LogClosedError",
    "NewLogError",
    "NnxError",
    "SequenceGapError",
    "TruncatedLogError",
    "UnsafePathError",
    "WriterAppearedError",
]


class NnxError(Exception):
    """Root of every error raised by nnx_es, events and projections."""


class EventLogError(NnxError, OSError):
    """The event log could not be opened, read or written."""


class TruncatedLogError(EventLogError):
    """The log's ``data.mdb`` is shorter than its pages need, or empty (0 bytes): a truncated write or copy."""


class DamagedLogError(EventLogError):
    """The log's bytes are damaged where no reader can go on by position: an LMDB meta page (bit rot
    there reads as another data format), or the last key, which is not a seq (its count is the log's length)."""


class NewLogError(EventLogError):
    """A read-only open found the log's data file without its events database: its writer is creating it
    (a run starting at this moment), or the file is another LMDB environment."""


class WriterAppearedError(EventLogError):
    """A quiet reader (:func:`events.log.quiet_readers`: read without LMDB's lock file because no other
    process had the log open) found that a process opened the log during its read: what it read may mix
    two states of the file. Read again: a new handle takes LMDB's lock, as beside any live writer."""


class LogClosedError(EventLogError):
    """An operation was attempted on a closed event log."""


class UnsafePathError(NnxError, PermissionError):
    """Something under a run directory is a symbolic link, or not the kind of file it must be (a FIFO,
    a device or a socket where a regular file belongs, a file where a directory belongs): refused,
    never followed, opened for writing or read (:mod:`events.paths`). The message names the path."""


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
    """The log's stored keys are not the seqs 0, 1, 2, ... in stored order.

    The key at some position is not the seq due there (``kind``):

    * ``"changed"``: the key after it is the seq due after this position, so this one
      key changed (bit rot in a key: the value stored there is most likely seq ``expected``);
    * ``"gap"``: a higher key (the seqs between are missing);
    * ``"duplicate"``: the key before it again;
    * ``"out of order"``: a lower key;
    * ``"malformed"``: a key that is not 8 bytes long.

    Attributes:
        expected: the seq due at that position.
        found: the key stored there, as a seq.
        previous: the key stored just before it (``None``: it is the first key).
        following: the key stored just after it (``None``: it is the last, or unknown).
        kind: one of the five above.
    """

    def __init__(self, expected: int, found: int, previous: int | None = None, following: int | None = None) -> None:
        after = f"key {found} follows key {previous}" if previous is not None else f"the first key is {found}"
        if found == expected:  # the right number in a key of another length
            kind = "malformed"
            message = f"malformed key: the key in the place of seq {expected} is not 8 bytes long"
        elif following == expected + 1:
            kind = "changed"
            message = f"changed key: {after} and precedes key {following}, in the place of seq {expected}"
        elif found > expected:
            kind = "gap"
            missing = f"seq {expected} is" if found == expected + 1 else f"seqs {expected}..{found - 1} are"
            message = f"sequence gap: expected seq {expected}, found seq {found} ({after}; {missing} missing)"
        elif found == previous:
            kind = "duplicate"
            message = f"duplicate key: {after} (expected seq {expected})"
        else:
            kind = "out of order"
            message = f"key out of order: {after} (expected seq {expected})"
        super().__init__(message)
        self.expected = expected
        self.found = found
        self.previous = previous
        self.following = following
        self.kind = kind
