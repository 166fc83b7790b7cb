"""One registry of event types, one Union, one encoder and one decoder.

Decoding upcasts legacy schema versions to today's structs, so every consumer
(projections, the audit, tools) only ever sees current types.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

import msgspec

from events.errors import CorruptEventError
from events.schema import (
    BestCommitted,
    CallbackBegan,
    CallbackCheckpointed,
    CallbackFinalized,
    CheckpointPruned,
    CheckpointStored,
    DiagnosticsRecorded,
    EpochBegan,
    EpochSummarized,
    EvaluationRecorded,
    Event,
    HistoryAppended,
    JournalPublished,
    LastCommitted,
    MicrobatchDone,
    ModelExported,
    ModelTransformed,
    MonitorDecided,
    ParamsDigested,
    PhaseCommitted,
    RunFailed,
    RunFinalized,
    RunResumed,
    RunStarted,
    RowsRecorded,
    SchedulerStepped,
    StopRequested,
    TrainBegan,
    UpdateCommitted,
    UpdateCommittedV1,
    UpdateSkipped,
    ValidationDone,
    WorldChanged,
)

__all__ = [
    "CURRENT_TYPES",
    "EVENT_TYPES",
    "KINDS",
    "TYPE_CODES",
    "AnyEvent",
    "decode",
    "decode_many",
    "encode",
    "kind_of",
    "partial_decoder",
    "skimming_decoder",
    "partial_type",
    "type_codes",
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
    CheckpointPruned,
    CallbackFinalized,
    RunFailed,
    RunFinalized,
    EvaluationRecorded,
    ParamsDigested,
    # appended, not in lifecycle order: the epoch's history step writes them before history_appended
    RowsRecorded,
    JournalPublished,
    # appended last, so every earlier type keeps its code: a transform at a boundary, an export after the run
    ModelTransformed,
    ModelExported,
    # appended: an elastic run's new deal of its global batch, after run_resumed (or a fork's run_started)
    WorldChanged,
    # appended: per-layer diagnostics at an epoch's end (nnx_es.diagnostics)
    DiagnosticsRecorded,
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


#: ``encode(event) -> bytes``: one event as msgpack bytes (the tag names kind and version). The
#: encoder's own method, so a call costs no Python frame: every event of a run passes here.
encode: Callable[[Event], bytes] = _encoder.encode


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


def _decode_list(decoder: msgspec.msgpack.Decoder[list[Any]], payloads: list[Any], first_seq: int) -> list[Any]:
    """Consecutive stored values decoded in one msgspec call (framed as one msgpack array), not upcast.

    When the array does not decode, the values are decoded one by one with the full
    types (:func:`decode`, which upcasts), so the error names the first bad seq.
    """
    n = len(payloads)
    try:
        events = decoder.decode(b"".join((b"\xdd" + n.to_bytes(4, "big"), *payloads)))
    except Exception:
        return [decode(p, first_seq + i) for i, p in enumerate(payloads)]
    if len(events) != n:  # a payload that is not one whole msgpack value shifts the framing
        return [decode(p, first_seq + i) for i, p in enumerate(payloads)]
    return events


_list_decoder: msgspec.msgpack.Decoder[list[Any]] = msgspec.msgpack.Decoder(list[AnyEvent])  # type: ignore[valid-type]


def decode_many(payloads: list[Any], first_seq: int = 0) -> list[Event]:
    """Decode consecutive stored events (seqs ``first_seq, first_seq + 1, ...``) in one call.

    The payloads are framed as one msgpack array and decoded by msgspec in C;
    legacy versions are upcast. Equal to ``[decode(p, seq) ...]``, and raises
    the same :class:`CorruptEventError` naming the first bad seq.
    """
    events = _decode_list(_list_decoder, payloads, first_seq)
    if not _LEGACY.isdisjoint(map(type, events)):
        ups = _UPCASTERS
        for i, event in enumerate(events):
            up = ups.get(type(event))
            if up is not None:
                events[i] = up(event)
    return events


class _TypeCodes(dict[type, int]):
    def __missing__(self, t: type) -> int:
        return 0


#: One byte per decodable type: its position in :data:`EVENT_TYPES`, plus one (0: any other type).
TYPE_CODES: Mapping[type, int] = _TypeCodes({t: i for i, t in enumerate(EVENT_TYPES, 1)})

_IS_LEGACY = bytes(int(t in _LEGACY) for t in (None, *EVENT_TYPES)).ljust(256, b"\0")  # a translate table


def type_codes(events: Iterable[Any]) -> bytes:
    """One byte per event: the code of its type in :data:`TYPE_CODES` (0 for a type not registered)."""
    return bytes(map(TYPE_CODES.__getitem__, map(type, events)))


class _PartialDecoder:
    __slots__ = ("_decoder", "_codes")

    def __init__(self, partials: Mapping[type[Event], type[Event]], complete: bool = True) -> None:
        for full, part in partials.items():
            _check_partial(full, part, complete)
        types = tuple(partials.get(t, t) for t in EVENT_TYPES)
        self._decoder: msgspec.msgpack.Decoder[list[Any]] = msgspec.msgpack.Decoder(
            list[Union[types]]  # type: ignore[valid-type]
        )
        self._codes = _TypeCodes(TYPE_CODES)
        self._codes.update({part: TYPE_CODES[full] for full, part in partials.items()})

    def __call__(self, payloads: list[Any], first_seq: int = 0) -> tuple[list[Any], bytes]:
        events = _decode_list(self._decoder, payloads, first_seq)
        codes = bytes(map(self._codes.__getitem__, map(type, events)))
        legacy = codes.translate(_IS_LEGACY)
        if 1 in legacy:
            for i in itertools.compress(range(len(events)), legacy):
                events[i] = upcast(events[i])
            codes = bytes(map(self._codes.__getitem__, map(type, events)))
        return events, codes


def partial_decoder(
    partials: Mapping[type[Event], type[Event]],
) -> Callable[[list[Any], int], tuple[list[Any], bytes]]:
    """A :func:`decode_many` that decodes the kinds of ``partials`` to lighter structs, and codes the events.

    A partial type (build it with :func:`partial_type`) stands for one current type: the same tag, every required field
    and some optional ones, with the same types and defaults. It accepts every value
    the full type accepts and refuses those lacking or mistyping a required field; the
    optional fields it leaves out are skipped, neither built nor validated. So a
    consumer that reads few fields of a frequent kind (the projections count
    ``microbatch_done``) does not pay for its lists, dicts and strings. The other
    types decode as in :func:`decode_many` (legacy versions upcast); when a chunk does
    not decode, its values are decoded one by one with the full types, so the
    :class:`CorruptEventError` names the first seq the full decoder refuses.

    The returned function gives ``(events, codes)``: ``codes[i]`` is the
    :data:`TYPE_CODES` code of the current type ``events[i]`` stands for (a partial
    type's full type), computed once for a consumer that classifies events by type.

    Raises:
        TypeError: a partial type is not such a subset of the type it stands for.
    """
    return _PartialDecoder(partials)


def skimming_decoder(
    skims: Mapping[type[Event], type[Event]],
) -> Callable[[list[Any], int], tuple[list[Any], bytes]]:
    """A :func:`partial_decoder` whose lighter types may leave out required fields too: each holds
    only the fields its reader reads (same names on the wire, types and defaults), so a value
    lacking or mistyping another required field is *not* refused. Only for a reader whose values
    are validated with the full types by another pass (the audit's second process,
    :mod:`nnx_es.audit.segments`).

    Raises:
        TypeError: a lighter type has another tag than the type it stands for, or a field that
            is not that type's (or is typed or defaulted otherwise).
    """
    return _PartialDecoder(skims, complete=False)


def partial_type(full: type[Event], *optional: str) -> type[Event]:
    """A partial type of the current event type ``full`` for :func:`partial_decoder`: its tag,
    every required field and the ``optional`` ones named, with the same types and defaults,
    derived from ``full`` (nothing copied by hand, so it cannot drift from the schema).

    Raises:
        TypeError: ``full`` is not a current event type, or an ``optional`` name is not one of
            its optional fields.
    """
    known = {f.name: f for f in msgspec.structs.fields(full)}
    wrong = [n for n in optional if n not in known or known[n].required]
    if wrong:
        raise TypeError(f"{full.__name__} has no optional field(s) {wrong}")
    fields: list[Any] = []
    for f in known.values():
        if f.required:
            fields.append((f.name, f.type))
        elif f.name in optional:
            default = (msgspec.field(default_factory=f.default_factory) if f.default is msgspec.NODEFAULT
                       else f.default)
            fields.append((f.name, f.type, default))
    config = full.__struct_config__  # type: ignore[attr-defined]
    part = msgspec.defstruct(
        f"{full.__name__}Partial", fields, bases=(Event,), module=__name__, tag=config.tag, frozen=True,
        kw_only=True, rename={f.name: f.encode_name for f in known.values()},
        namespace={"KIND": full.KIND, "VERSION": full.VERSION},
    )
    _check_partial(full, part)
    return part


def _check_partial(full: type[Event], part: type[Event], complete: bool = True) -> None:
    if full not in CURRENT_TYPES:
        raise TypeError(f"partial type {part.__name__} stands for {full.__name__}, expected a current event type")
    fc, pc = full.__struct_config__, part.__struct_config__  # type: ignore[attr-defined]
    if (pc.tag_field, pc.tag, part.KIND, part.VERSION) != (fc.tag_field, fc.tag, full.KIND, full.VERSION):
        raise TypeError(f"partial type {part.__name__} has tag {pc.tag!r}, expected {full.__name__}'s {fc.tag!r}")
    fields = {f.name: f for f in msgspec.structs.fields(full)}
    declared = {f.name for f in msgspec.structs.fields(part)}
    for f in fields.values():
        if complete and f.required and f.name not in declared:
            raise TypeError(f"partial type {part.__name__} leaves out {full.__name__}'s required field {f.name!r}")
    for f in msgspec.structs.fields(part):
        like = fields.get(f.name)
        if like is None:
            raise TypeError(f"field {f.name!r} of partial type {part.__name__} is not a field of {full.__name__}")
        # the same name on the wire, type and default: it accepts what the full field accepts
        if (f.encode_name, f.type, f.default, f.default_factory) != (
            like.encode_name, like.type, like.default, like.default_factory
        ):
            raise TypeError(
                f"field {f.name!r} of partial type {part.__name__} is {_describe(f)}, "
                f"expected {full.__name__}'s {_describe(like)}"
            )


def _describe(f: msgspec.structs.FieldInfo) -> str:
    if f.required:
        return f"{f.type!r}, required"
    default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
    return f"{f.type!r} defaulting to {default!r}"


def kind_of(event: Event) -> str:
    """The stable kind name of ``event`` (version suffix stripped)."""
    return event.KIND
