"""One registry of event types, one Union, one encoder and one decoder.

Decoding upcasts legacy schema versions to today's structs, so every consumer
(projections, the audit, tools) only ever sees current types.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import msgspec

from events.errors import CorruptEventError
from events.schema import (
    BestCommitted,
    CallbackBegan,
    CallbackCheckpointed,
    CallbackFinalized,
    CheckpointStored,
    EpochBegan,
    EpochSummarized,
    Event,
    HistoryAppended,
    LastCommitted,
    MicrobatchDone,
    MonitorDecided,
    PhaseCommitted,
    RunFailed,
    RunFinalized,
    RunResumed,
    RunStarted,
    SchedulerStepped,
    StopRequested,
    TrainBegan,
    UpdateCommitted,
    UpdateCommittedV1,
    UpdateSkipped,
    ValidationDone,
)

__all__ = [
    "CURRENT_TYPES",
    "EVENT_TYPES",
    "KINDS",
    "AnyEvent",
    "decode",
    "decode_many",
    "encode",
    "kind_of",
    "upcast",
]

#: Today's event types, in lifecycle order.
CURRENT_TYPES: tuple[type[Event], ...] = (
    RunStarted,
    RunResumed,
    CallbackBegan,
    TrainBegan,
    EpochBegan,
    MicrobatchDone,
    UpdateCommitted,
    UpdateSkipped,
    ValidationDone,
    EpochSummarized,
    MonitorDecided,
    SchedulerStepped,
    StopRequested,
    HistoryAppended,
    CheckpointStored,
    LastCommitted,
    BestCommitted,
    PhaseCommitted,
    CallbackCheckpointed,
    CallbackFinalized,
    RunFailed,
    RunFinalized,
)


def _update_committed_v1(old: Any) -> Event:
    return UpdateCommitted(
        step=old.step,
        epoch=old.epoch,
        microbatches=old.microbatches,
        local_examples=old.examples,
        global_examples=old.examples,
        loss=old.loss,
        lrs=[old.lr],
        optimizer=old.optimizer,
    )


#: Legacy struct -> function building today's event from it.
_UPCASTERS: dict[type[Event], Callable[[Any], Event]] = {
    UpdateCommittedV1: _update_committed_v1,
}

_LEGACY = frozenset(_UPCASTERS)

#: Every decodable type: today's and the legacy versions.
EVENT_TYPES: tuple[type[Event], ...] = CURRENT_TYPES + tuple(_UPCASTERS)

#: Stable kind names of today's types.
KINDS: tuple[str, ...] = tuple(t.KIND for t in CURRENT_TYPES)

AnyEvent = Union[EVENT_TYPES]  # type: ignore[valid-type]

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(AnyEvent)
_list_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(list[AnyEvent])  # type: ignore[valid-type]


def encode(event: Event) -> bytes:
    """Serialize one event to msgpack bytes (the tag names kind and version)."""
    return _encoder.encode(event)


def upcast(event: Event) -> Event:
    """Return today's struct for ``event`` (itself when already current)."""
    up = _UPCASTERS.get(type(event))
    return event if up is None else up(event)


def decode(payload: bytes | memoryview, seq: int | None = None) -> Event:
    """Decode one stored event, upcasting an older schema version.

    Raises:
        CorruptEventError: the payload is not msgpack, names an unknown kind or
            version, or lacks a required field; the error names ``seq``.
    """
    try:
        event = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptEventError(seq, str(exc)) from None
    except Exception as exc:  # msgspec raises a few others on hostile input
        raise CorruptEventError(seq, f"{type(exc).__name__}: {exc}") from None
    up = _UPCASTERS.get(type(event))
    return event if up is None else up(event)


def decode_many(payloads: list[Any], first_seq: int = 0) -> list[Event]:
    """Decode consecutive stored events (seqs ``first_seq, first_seq + 1, ...``) in one call.

    The payloads are framed as one msgpack array and decoded by msgspec in C;
    legacy versions are upcast. Equal to ``[decode(p, seq) ...]``, and raises
    the same :class:`CorruptEventError` naming the first bad seq.
    """
    n = len(payloads)
    try:
        events = _list_decoder.decode(b"\xdd" + n.to_bytes(4, "big") + b"".join(payloads))
    except Exception:
        return [decode(p, first_seq + i) for i, p in enumerate(payloads)]
    if len(events) != n:  # a payload that is not one whole msgpack value shifts the framing
        return [decode(p, first_seq + i) for i, p in enumerate(payloads)]
    if not _LEGACY.isdisjoint(map(type, events)):
        ups = _UPCASTERS
        for i, event in enumerate(events):
            up = ups.get(type(event))
            if up is not None:
                events[i] = up(event)
    return events


def kind_of(event: Event) -> str:
    """The stable kind name of ``event`` (version suffix stripped)."""
    return event.KIND
