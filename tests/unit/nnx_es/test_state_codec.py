"""The "tensors" checkpoint codec: exact round trips against torch.save, and a refusal for what it cannot hold."""

from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from events import Counters
from nnx_es.checkpoint import INLINE_MAX, load_component, read_manifest, verify_checkpoint, write_checkpoint
from nnx_es.errors import CorruptCheckpointError
from nnx_es.state_codec import DTYPES, NUMPY_DTYPES, decode_state, encode_state
from nnx_es.storage import BlobStore


def _torch_round_trip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same(a: Any, b: Any) -> None:
    """Equal in type, structure, dtype, shape, values (NaN included) and state-dict metadata."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        # bitwise, NaN payloads included
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b or (a != a and b != b)


def _trained_states() -> list[Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))
    opts = [torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.8, 0.99)),
            torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)]
    for opt in opts:
        net(torch.randn(8, 5)).sum().backward()
        opt.step()
    sched = torch.optim.lr_scheduler.OneCycleLR(opts[0], max_lr=0.1, total_steps=10)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opts[1])
    plateau.step(1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return [net.state_dict(), *(o.state_dict() for o in opts), sched.state_dict(), plateau.state_dict(),
            scaler.state_dict()]


@pytest.mark.parametrize("index", range(6))
def test_real_state_dicts_round_trip_exactly_as_torch_save_does(index):
    state = _trained_states()[index]
    data = encode_state(state)
    assert data is not None
    _same(decode_state(data), _torch_round_trip(state))


def test_module_version_metadata_survives_and_a_loaded_state_trains_on_equally():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    decoded = decode_state(encode_state(net.state_dict()))
    assert decoded._metadata == net.state_dict()._metadata and decoded._metadata[""] is not None
    twin = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    twin.load_state_dict(decoded)
    x = torch.randn(4, 3)
    assert torch.equal(twin(x), net(x))


_dtype = st.sampled_from(sorted(DTYPES))
_shape = st.lists(st.integers(0, 3), max_size=3)


@st.composite
def _tensors(draw: Any) -> torch.Tensor:
    dtype, shape = DTYPES[draw(_dtype)], draw(_shape)
    numel = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if raw else \
        torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        t = t.view(torch.uint8).bool() if t.numel() else t  # only 0/1 are valid bools
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous
    return t


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                  st.text(max_size=5), st.binary(max_size=5), _tensors())
_tree = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(-5, 5)), kids, max_size=3),
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(_tree)
def test_any_tree_of_plain_containers_and_tensors_round_trips_exactly(tree):
    data = encode_state(tree)
    assert data is not None
    _same(decode_state(data), tree)


def test_decoded_tensors_are_writable_and_share_no_memory():
    w = torch.arange(6.0).reshape(2, 3)
    state = decode_state(encode_state({"a": w, "b": w}))
    state["a"].add_(1)  # writable (no read-only buffer warning or error)
    assert torch.equal(state["b"], w) and torch.equal(w, torch.arange(6.0).reshape(2, 3))


def test_encoding_is_a_snapshot_that_later_training_cannot_change():
    w = torch.zeros(3)
    data = encode_state({"w": w})
    w.add_(5)
    assert torch.equal(decode_state(data)["w"], torch.zeros(3))


@pytest.mark.parametrize("name", sorted(NUMPY_DTYPES))
def test_numpy_numbers_and_arrays_keep_their_type_and_bytes(name):
    dtype = NUMPY_DTYPES[name]
    values = np.arange(6).astype(dtype)
    state = {"lr": values[3], "array": values.reshape(2, 3), "strided": values.reshape(2, 3).T,
             "empty": np.zeros((0, 2), dtype=dtype), "group": [{"lr": values[1], "betas": (values[2], 0.5)}]}
    decoded = decode_state(encode_state(state))
    assert type(decoded["lr"]) is type(state["lr"]) and decoded["lr"].tobytes() == state["lr"].tobytes()
    for key in ("array", "strided", "empty"):
        got, want = decoded[key], state[key]
        assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == np.ascontiguousarray(want).tobytes() and got.flags.writeable
    assert type(decoded["group"][0]["betas"]) is tuple
    assert type(decoded["group"][0]["betas"][0]) is type(values[2])


@pytest.mark.parametrize("state", [
    {"w": torch.zeros(2, 2).to_sparse()},  # sparse
    {"w": nn.Parameter(torch.zeros(2))},  # a tensor subclass
    {"w": torch.zeros(2, dtype=torch.float8_e4m3fn)},  # a dtype outside DTYPES
    {"w": torch.empty(2, device="meta")},  # a meta tensor (no data)
    {"w": np.array([object()])},  # an object array
    {"w": np.array([1.0], dtype=">f8")},  # a non-native byte order
    {"w": np.str_("x")},  # a NumPy string
    {(1, 2): 3},  # a tuple key
    {"big": 2**70},  # an int beyond 64 bits
    {"s": {1, 2}},  # a set
])
def test_what_the_codec_cannot_hold_exactly_is_refused_for_torch_save(state):
    assert encode_state(state) is None


@pytest.mark.parametrize("damage", ["truncate", "dtype", "size", "offset", "length"])
def test_damaged_bytes_do_not_decode(damage):
    data = encode_state({"w": torch.zeros(4)})
    header = msgspec.msgpack.encode(["float32", [4], 0, 16])
    assert header in data
    bad = {
        "truncate": data[:-3],  # the data section ends early
        "dtype": data.replace(header, msgspec.msgpack.encode(["float99", [4], 0, 16])),
        "size": data.replace(header, msgspec.msgpack.encode(["float32", [5], 0, 16])),
        "offset": data.replace(header, msgspec.msgpack.encode(["float32", [4], 9, 16])),
        "length": (2**40).to_bytes(8, "little") + data[8:],  # the tree's length runs past the end
    }[damage]
    with pytest.raises(ValueError):
        decode_state(bad)


def test_each_tensor_is_one_slice_of_the_data_section():
    w, b = torch.arange(6.0).reshape(2, 3), torch.tensor([7, 8], dtype=torch.int16)
    data = encode_state({"w": w, "b": b})
    tail = w.numpy().tobytes() + b.numpy().tobytes()
    assert data.endswith(tail)  # the bytes follow the tree, in order, uncompressed, once
    assert len(data) == 8 + int.from_bytes(data[:8], "little") + len(tail)


def test_a_checkpoint_keeps_small_states_inline_and_big_ones_in_blobs(tmp_path: Path):
    store = BlobStore(tmp_path / "blobs")
    small, big = {"w": torch.ones(8)}, {"w": torch.ones(INLINE_MAX // 4 + 1)}
    parts = {"model": ("tensors", encode_state(small)), "optimizer/adam": ("tensors", encode_state(big))}
    digest, _ = write_checkpoint(store, run_id="r", epoch=0, step=1, counters=Counters(), parts=parts)
    manifest = verify_checkpoint(store, digest, run_id="r")
    assert manifest.format == 3
    assert manifest.components["model"].data is not None and manifest.components["optimizer/adam"].data is None
    _same(load_component(store, manifest, "model"), small)
    _same(load_component(store, manifest, "optimizer/adam"), big)
    # bytes that hash right but do not decode are refused, naming the component
    digest, _ = write_checkpoint(store, run_id="r", epoch=0, step=1, counters=Counters(),
                                 parts={"model": ("tensors", b"\xc1")})  # 0xc1: never valid msgpack
    with pytest.raises(CorruptCheckpointError, match="'model' does not decode"):
        load_component(store, read_manifest(store, digest), "model")
