"""Crafted "tensors" codec bytes (a checkpoint component someone else wrote) raise ValueError, never another
error, never a hang, never an allocation past the bytes given.

Hypothesis builds the codec's layout with hostile fields -- dtypes outside the closed set, shapes with
negative, huge or too many sizes, offsets and sizes outside the data section, payloads that are not the
four fields, tuples and state dicts that are not arrays, bool bytes other than 0/1, deep nesting -- and
plain random bytes; each case is bounded by a deadline, and the whole file runs in seconds.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events import Counters
from nnx_es.checkpoint import Component, Manifest, load_component
from nnx_es.errors import CorruptCheckpointError
from nnx_es.state_codec import MAX_DEPTH, decode_state, encode_state
from nnx_es.storage import BlobStore

_TENSOR, _TUPLE, _STATE_DICT, _NUMPY = 1, 2, 3, 4
_FUZZ = settings(max_examples=150, deadline=500, suppress_health_check=[HealthCheck.too_slow])


def _layout(tree: Any, section: bytes) -> bytes:
    encoded = msgspec.msgpack.encode(tree)
    return len(encoded).to_bytes(8, "little") + encoded + section


def _ext(code: int, payload: Any) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, msgspec.msgpack.encode(payload))


def _decodes_or_refuses(data: bytes) -> None:
    try:
        decode_state(data)
    except ValueError:
        pass


_ints = st.one_of(st.integers(-3, 70), st.integers(-(1 << 63), (1 << 64) - 1), st.just((1 << 63) - 1))  # msgpack ints
_names = st.one_of(st.sampled_from(["float32", "bool", "int64", "bfloat16", "uint16", "object", "qint8", ""]),
                   st.text(max_size=8))
_shapes = st.one_of(st.lists(_ints, max_size=5), st.lists(st.integers(0, 2), min_size=60, max_size=70),
                    st.none(), st.text(max_size=3), _ints)
_payloads = st.one_of(
    st.tuples(_names, _shapes, _ints, _ints).map(list),
    st.lists(st.one_of(_ints, _names, _shapes), max_size=6),
    st.dictionaries(st.text(max_size=3), _ints, max_size=2),
    st.binary(max_size=8),
)
_leaves = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=4),
                    st.binary(max_size=4))


def _nodes(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(-3, 3)), children, max_size=3),
        st.builds(_ext, st.just(_TUPLE), st.one_of(st.lists(children, max_size=3), children)),
        st.builds(_ext, st.just(_STATE_DICT), st.one_of(
            st.tuples(st.dictionaries(st.text(max_size=3), children, max_size=2),
                      st.dictionaries(st.text(max_size=3), children, max_size=2)).map(list), children)),
    )


_trees = st.recursive(
    st.one_of(_leaves, st.builds(_ext, st.sampled_from([_TENSOR, _NUMPY, 0, 5, 127]), _payloads)), _nodes,
    max_leaves=12)


@_FUZZ
@given(tree=_trees, section=st.binary(max_size=64))
def test_a_crafted_tree_decodes_or_is_refused_with_a_value_error(tree: Any, section: bytes):
    _decodes_or_refuses(_layout(tree, section))


@_FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_decode_or_are_refused_with_a_value_error(data: bytes):
    _decodes_or_refuses(data)


@_FUZZ
@given(at=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_a_real_state_with_a_changed_byte_decodes_or_is_refused_with_a_value_error(at: int, byte: int):
    torch.manual_seed(0)
    data = bytearray(encode_state(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()).state_dict()))
    data[at % len(data)] = byte
    _decodes_or_refuses(bytes(data))


@pytest.mark.parametrize("payload, why", [
    (["float32", [1 << 20, 1 << 20], 0, 4 << 40], "needs"),  # 4 TiB declared: refused, nothing allocated
    (["float32", [-1, -4], 0, 16], "fields do not decode"),  # negative sizes
    (["float32", [1] * 65, 0, 4], "fields do not decode"),  # more sizes than torch has dimensions
    (["float32", [0, 1 << 62, 1 << 62], 0, 0], "cannot be built"),  # empty, but its strides overflow
    (["bool", [2], 0, 2], "other than 0 or 1"),
    (["float32", [1], 0], "fields do not decode"),
    ("float32", "fields do not decode"),
    (["torch.onnx", [1], 0, 4], "unknown tensor dtype"),
])
def test_a_crafted_tensor_is_refused_naming_why(payload: Any, why: str):
    with pytest.raises(ValueError, match=why):
        decode_state(_layout({"w": _ext(_TENSOR, payload)}, b"\x02\x00\x00\x00"))


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_containers_nested_past_the_bound_are_refused(depth: int):
    encoded = msgspec.msgpack.encode([])
    for _ in range(min(depth, 2_000)):  # tuples in tuples: each level is an extension decoded on its own
        encoded = msgspec.msgpack.encode(msgspec.msgpack.Ext(_TUPLE, encoded))
    with pytest.raises(ValueError, match="nest"):
        decode_state(len(encoded).to_bytes(8, "little") + encoded)
    plain = b"\x91" * depth + b"\x90"  # arrays in arrays, in one msgpack value
    with pytest.raises(ValueError, match="nest"):
        decode_state(len(plain).to_bytes(8, "little") + plain)


def test_a_crafted_component_loads_as_a_corrupt_checkpoint_never_another_error(tmp_path):
    data = _layout({"w": _ext(_TENSOR, ["float32", [1 << 40], 0, 4 << 40])}, b"")
    comp = Component(blob=hashlib.sha256(data).hexdigest(), codec="tensors", bytes=len(data), data=data)
    manifest = Manifest(run_id="r", epoch=0, step=0, counters=Counters(), components={"model": comp})
    with pytest.raises(CorruptCheckpointError, match="component 'model' does not decode: a float32 tensor"):
        load_component(BlobStore(tmp_path / "blobs"), manifest, "model")
