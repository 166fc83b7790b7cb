"""The event codec: tags, round trips, upcasting of stored v1 payloads, and refusal of bad input."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import events
from events import (
    CURRENT_TYPES,
    EVENT_TYPES,
    KINDS,
    CorruptEventError,
    NnxError,
    UpdateCommitted,
    UpdateCommittedV1,
    decode,
    encode,
    kind_of,
    upcast,
)
from events.codec import TYPE_CODES, decode_many, partial_decoder, partial_type, type_codes
from events.schema import Event, MicrobatchDone


def _tag(t: type) -> Any:
    return t.__struct_config__.tag  # type: ignore[attr-defined]


def _v1_receipt_payload(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "kind": "update_committed",
        "step": 7,
        "epoch": 2,
        "microbatches": 4,
        "examples": 128.0,
        "loss": 0.5,
        "lr": 0.01,
        "optimizer": "adam",
    }
    base.update(over)
    return base


# --- tags and registry -------------------------------------------------------------


def test_every_type_has_an_explicit_stable_tag_and_kind() -> None:
    for t in EVENT_TYPES:
        tag = _tag(t)
        assert isinstance(tag, str) and tag, t
        assert tag != t.__name__, f"{t.__name__} uses the class-name default tag"
        assert t.__struct_config__.tag_field == "kind"  # type: ignore[attr-defined]
        assert t.KIND and t.KIND == t.KIND.lower()
        expected = t.KIND if t.VERSION == 1 else f"{t.KIND}@{t.VERSION}"
        assert tag == expected, f"{t.__name__}: tag {tag!r}, expected {expected!r} for version {t.VERSION}"
        assert t.__struct_config__.frozen  # type: ignore[attr-defined]


def test_tags_and_kinds_are_unique() -> None:
    tags = [_tag(t) for t in EVENT_TYPES]
    assert len(tags) == len(set(tags))
    assert len(KINDS) == len(set(KINDS))
    assert KINDS == tuple(t.KIND for t in CURRENT_TYPES)


def test_legacy_types_are_decodable_but_not_current() -> None:
    assert UpdateCommittedV1 in EVENT_TYPES
    assert UpdateCommittedV1 not in CURRENT_TYPES
    assert set(CURRENT_TYPES) < set(EVENT_TYPES)
    # every current type is exported by the package
    for t in CURRENT_TYPES:
        assert getattr(events, t.__name__) is t
        assert t.__name__ in events.__all__


# --- round trips -------------------------------------------------------------------


@pytest.mark.parametrize("cls", CURRENT_TYPES, ids=lambda t: t.KIND)
def test_round_trip_of_every_current_type(cls: type, sample_events: dict[type, Any]) -> None:
    event = sample_events[cls]
    payload = encode(event)
    assert msgspec.msgpack.decode(payload)["kind"] == _tag(cls)
    back = decode(payload)
    assert type(back) is cls
    assert back == event
    assert kind_of(back) == cls.KIND
    # every field, defaulted ones included, was set to a non-default value and carried
    for f in msgspec.structs.fields(cls):
        assert getattr(back, f.name) == getattr(event, f.name), f.name
        if not f.required:
            default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
            assert getattr(back, f.name) != default, f"{f.name} round-tripped only its default"


# --- upcasting ---------------------------------------------------------------------


def test_stored_v1_receipt_decodes_into_todays_update_committed() -> None:
    raw = msgspec.msgpack.encode(_v1_receipt_payload())
    event = decode(raw, seq=11)
    assert type(event) is UpdateCommitted
    assert event == UpdateCommitted(
        step=7,
        epoch=2,
        microbatches=4,
        local_examples=128.0,
        global_examples=128.0,
        loss=0.5,
        lrs=[0.01],
        optimizer="adam",
    )
    # fields v1 did not have take today's defaults
    assert event.grad_norm is None
    assert event.clipped is False
    assert event.data_parallel_size == 1
    assert kind_of(event) == "update_committed"


def test_v1_receipt_without_optional_field_gets_its_default() -> None:
    payload = _v1_receipt_payload()
    del payload["optimizer"]
    event = decode(msgspec.msgpack.encode(payload))
    assert isinstance(event, UpdateCommitted)
    assert event.optimizer == "default"
    assert event.lrs == [0.01]


def test_upcast_of_a_legacy_struct_and_of_a_current_one() -> None:
    old = UpdateCommittedV1(step=1, epoch=0, microbatches=2, examples=64.0, loss=1.5, lr=0.2)
    new = upcast(old)
    assert type(new) is UpdateCommitted
    assert (new.local_examples, new.global_examples, new.lrs) == (64.0, 64.0, [0.2])
    assert upcast(new) is new


def test_current_payload_missing_a_defaulted_field_gets_the_default() -> None:
    full = msgspec.msgpack.decode(
        encode(UpdateCommitted(step=1, epoch=0, microbatches=1, local_examples=8.0, global_examples=16.0, loss=0.1))
    )
    del full["precision"]
    del full["data_parallel_size"]
    event = decode(msgspec.msgpack.encode(full))
    assert isinstance(event, UpdateCommitted)
    assert (event.precision, event.data_parallel_size, event.global_examples) == ("fp32", 1, 16.0)


# --- refusal -----------------------------------------------------------------------


def _assert_corrupt(payload: bytes, seq: int | None = 5) -> CorruptEventError:
    with pytest.raises(CorruptEventError) as info:
        decode(payload, seq)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, NnxError)
    assert err.seq == seq
    assert err.reason
    if seq is not None:
        assert f"seq {seq}" in str(err)
    return err


def test_unknown_kind_is_refused() -> None:
    err = _assert_corrupt(msgspec.msgpack.encode({"kind": "epoch_exploded", "epoch": 1}))
    assert "epoch_exploded" in err.reason


def test_unknown_version_tag_is_refused() -> None:
    _assert_corrupt(msgspec.msgpack.encode(_v1_receipt_payload(kind="update_committed@9")), seq=0)


def test_missing_required_field_is_refused() -> None:
    payload = _v1_receipt_payload()
    del payload["lr"]
    err = _assert_corrupt(msgspec.msgpack.encode(payload), seq=3)
    assert "lr" in err.reason


def test_wrong_field_type_is_refused() -> None:
    _assert_corrupt(msgspec.msgpack.encode({"kind": "epoch_began", "epoch": "zero"}))


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"\x93\x01", b"garbage bytes", msgspec.msgpack.encode([1, 2, 3]), msgspec.msgpack.encode(7)],
    ids=["empty", "reserved-byte", "truncated", "text", "array", "int"],
)
def test_garbage_is_refused(payload: bytes) -> None:
    _assert_corrupt(payload)
    _assert_corrupt(payload, seq=None)


def test_error_without_seq_says_payload() -> None:
    err = _assert_corrupt(b"\xc1", seq=None)
    assert "payload" in str(err)


# --- fuzzing -----------------------------------------------------------------------

_ALL_TAGS = [_tag(t) for t in EVENT_TYPES]
_FIELD_NAMES = sorted({f.name for t in EVENT_TYPES for f in msgspec.structs.fields(t)})

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_value = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _decode_or_corrupt(payload: bytes) -> Any:
    try:
        return decode(payload, seq=1)
    except CorruptEventError as err:
        assert err.seq == 1
        return None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decode_of_arbitrary_bytes_raises_only_corrupt_event(payload: bytes) -> None:
    event = _decode_or_corrupt(payload)
    if event is not None:
        assert type(event) in CURRENT_TYPES


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(_ALL_TAGS + ["", "update_committed@3", "EpochBegan"]),
    fields=st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=6), _value, max_size=8),
)
def test_decode_of_tagged_maps_with_random_fields(kind: str, fields: dict[str, Any]) -> None:
    payload = msgspec.msgpack.encode({**fields, "kind": kind})
    event = _decode_or_corrupt(payload)
    if event is not None:
        # whatever decodes is a current event that survives its own round trip
        assert type(event) in CURRENT_TYPES
        assert decode(encode(event)) == event


# --- partial decoding ----------------------------------------------------------------


_Counted = partial_type(MicrobatchDone)
_Steps = partial_type(UpdateCommitted, "data_parallel_size")


_PARTIALS = {MicrobatchDone: _Counted, UpdateCommitted: _Steps}
_decode_partially = partial_decoder(_PARTIALS)


def _as_read(full: Any, part: Any) -> None:
    """``part`` is what a partial decoder gave for the event ``full`` decodes to (an upcast one in full)."""
    if type(part) is not type(full):
        assert type(part) is _PARTIALS[type(full)]
        assert msgspec.structs.asdict(part) == {
            k: v for k, v in msgspec.structs.asdict(full).items() if k in part.__struct_fields__
        }
    else:
        assert part == full


def test_partial_decoding_reads_the_declared_fields_and_codes_every_event(sample_events: dict[type, Any]) -> None:
    events = list(sample_events.values()) * 2
    payloads = [encode(e) for e in events]
    full = decode_many(payloads)
    parts, codes = _decode_partially(payloads, 0)
    assert len(parts) == len(full)
    for f, p in zip(full, parts):
        _as_read(f, p)
    assert codes == type_codes(full)  # a legacy event is upcast, a partial one coded as its full type
    assert {_Counted, _Steps, UpdateCommitted} <= set(map(type, parts))  # UpdateCommitted: the upcast v1
    assert UpdateCommittedV1 in map(type, events) and UpdateCommittedV1 not in map(type, parts)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_ALL_TAGS + ["", "EpochBegan"]),
            st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=6), _value, max_size=8),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_partial_decoding_accepts_what_the_full_decoder_accepts_and_names_the_same_seq(maps: Any) -> None:
    payloads = [msgspec.msgpack.encode({**fields, "kind": kind}) for kind, fields in maps]
    try:
        full: list[Any] | None = decode_many(payloads, 10)
    except CorruptEventError as exc:
        full, bad = None, exc.seq
    try:
        parts, codes = _decode_partially(payloads, 10)
    except CorruptEventError as exc:
        assert full is None and exc.seq == bad  # refused: the first value the full decoder refuses
        return
    if full is not None:
        for f, p in zip(full, parts, strict=True):
            _as_read(f, p)
        assert codes == type_codes(full)


_REQUIRED = [(f.name, f.type) for f in msgspec.structs.fields(UpdateCommitted) if f.required]


@pytest.mark.parametrize(
    "fields, tag, reason",
    [
        ([("optimizer", int, "default")], "update_committed@2", "field 'optimizer' of"),  # another type
        ([("data_parallel_size", int)], "update_committed@2", "field 'data_parallel_size' of"),  # required
        ([("data_parallel_size", int, 2)], "update_committed@2", "field 'data_parallel_size' of"),  # other default
        ([("rank", int, 0)], "update_committed@2", "field 'rank' of"),  # not a field of the full type
        ([], "update_committed", "has tag 'update_committed'"),  # the legacy version's tag
        ([("drop", None)], "update_committed@2", "leaves out UpdateCommitted's required field 'loss'"),
    ],
)
def test_a_partial_type_that_accepts_or_refuses_otherwise_than_its_full_type_is_refused(
    fields: Any, tag: str, reason: str
) -> None:
    declared = [f for f in _REQUIRED if f[0] != "loss"] if fields == [("drop", None)] else _REQUIRED + fields
    part = msgspec.defstruct("Part", declared, bases=(Event,), tag=tag, kw_only=True, frozen=True,
                             namespace={"KIND": "update_committed", "VERSION": 2})
    with pytest.raises(TypeError, match=f"{reason}|partial type Part {reason}"):
        partial_decoder({UpdateCommitted: part})
    with pytest.raises(TypeError, match="expected a current event type"):
        partial_decoder({UpdateCommittedV1: _Steps})


def test_type_codes_are_one_distinct_byte_per_registered_type() -> None:
    assert sorted(TYPE_CODES[t] for t in EVENT_TYPES) == list(range(1, len(EVENT_TYPES) + 1))
    assert type_codes([]) == b""
    assert type_codes([UpdateCommitted(step=1, epoch=0, microbatches=1, local_examples=1.0, global_examples=1.0,
                                       loss=0.0), "not an event"]) == bytes([TYPE_CODES[UpdateCommitted], 0])


def test_partial_type_keeps_every_required_field_and_only_the_optional_ones_named() -> None:
    part = partial_type(UpdateCommitted, "lrs")
    full = {f.name: f for f in msgspec.structs.fields(UpdateCommitted)}
    kept = {f.name: f for f in msgspec.structs.fields(part)}
    assert set(kept) == {n for n, f in full.items() if f.required} | {"lrs"}
    assert all((f.type, f.default, f.default_factory) == (full[n].type, full[n].default, full[n].default_factory)
               for n, f in kept.items())
    assert (part.KIND, part.VERSION) == (UpdateCommitted.KIND, UpdateCommitted.VERSION)
    receipt = UpdateCommitted(step=3, epoch=0, microbatches=1, local_examples=2.0, global_examples=2.0, loss=0.5,
                              lrs=[0.1], grad_norm=1.5)
    (got,), codes = partial_decoder({UpdateCommitted: part})([encode(receipt)])
    assert type(got) is part and (got.step, got.lrs) == (3, [0.1]) and not hasattr(got, "grad_norm")
    with pytest.raises(TypeError, match=r"no optional field\(s\) \['step', 'rank'\]"):
        partial_type(UpdateCommitted, "step", "rank")  # required, and not a field
    with pytest.raises(TypeError, match="expected a current event type"):
        partial_type(UpdateCommittedV1)
