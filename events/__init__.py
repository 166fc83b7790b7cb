"""nnx_es's event vocabulary and its append-only log (no torch, no nnx_es imports)."""

from events.chunks import RawChunk, StoredPairs
from events.codec import CURRENT_TYPES, EVENT_TYPES, KINDS, AnyEvent, decode, encode, kind_of, upcast
from events.errors import CorruptEventError, EventLogError, LogClosedError, NnxError, SequenceGapError, UnsafePathError
from events.log import EventLog, LmdbLog, MemoryLog, seq_key
from events.schema import *  # noqa: F403
from events.sums import SumProblem, SumRecord
from events.schema import __all__ as _schema_all

__all__ = [
    "CURRENT_TYPES",
    "EVENT_TYPES",
    "KINDS",
    "AnyEvent",
    "CorruptEventError",
    "EventLog",
    "EventLogError",
    "LmdbLog",
    "LogClosedError",
    "MemoryLog",
    "NnxError",
    "RawChunk",
    "SequenceGapError",
    "StoredPairs",
    "SumProblem",
    "SumRecord",
    "UnsafePathError",
    "decode",
    "encode",
    "kind_of",
    "seq_key",
    "upcast",
    *_schema_all,
]
