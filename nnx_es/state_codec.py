"""The ``"tensors"`` checkpoint codec: a state dict as msgpack, each tensor's bytes after it.

A model's, optimizer's or scheduler's ``state_dict()`` is plain containers
(``dict``/``OrderedDict`` with ``str``/``int`` keys, ``list``, ``tuple``),
plain leaves (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``),
dense tensors, and at times NumPy numbers (a learning rate drawn with
``np.logspace`` is an ``np.float64``). :func:`encode_state` writes such a tree as::

    length of the tree (8 bytes, little-endian) | the tree (msgpack) | data section

The tree is msgpack with three extension types::

    1  tensor     msgpack [dtype name, shape, offset, nbytes]: its bytes (C order, native
                  byte order) at ``offset`` in the data section
    2  tuple      msgpack array of the items (a plain array decodes as a list)
    3  state dict msgpack [items map, ``_metadata`` map]   (an OrderedDict carrying
                  ``nn.Module`` version metadata, as ``nn.Module.state_dict`` returns)
    4  NumPy      msgpack [dtype name, shape or None (a scalar), offset, nbytes]: a NumPy
                  number or array of a dtype in :data:`NUMPY_DTYPES`, its bytes in the
                  data section (its type is kept: ``np.float32`` arithmetic differs from ``float``'s)

Like safetensors' header-then-data layout, each tensor's bytes are copied once
(into the result), so the result is a snapshot that later training cannot change,
taken in microseconds for a small model where ``torch.save`` (a zip of pickles)
takes hundreds (DESIGN.md "Performance budget"), and in one memory copy of the
state for a big one. Decoding unpickles nothing, and the only things it builds
are the containers above and tensors of the dtypes in :data:`DTYPES`.

A tree with anything else -- a tensor subclass, a sparse, quantized or meta
tensor, a dtype outside :data:`DTYPES`, an object array, a key that is not a
``str``/``int``, an int beyond 64 bits -- is not encoded (:func:`encode_state`
returns ``None``) and the checkpoint keeps it with the ``"torch"`` codec.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated, Any, Optional

import msgspec
import numpy as np
import torch
from torch import Tensor

__all__ = ["DTYPES", "MAX_DEPTH", "MAX_DIMS", "NUMPY_DTYPES", "decode_state", "encode_state"]

_TENSOR, _TUPLE, _STATE_DICT, _NUMPY = 1, 2, 3, 4

#: dtypes the codec stores (by name); any other dtype falls back to ``torch.save``
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}
_NAMES = {d: n for n, d in DTYPES.items()}
#: NumPy dtypes (numbers and bools, native byte order) the codec stores, by name
NUMPY_DTYPES: dict[str, np.dtype] = {
    d.name: d for d in map(np.dtype, (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                      np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128))
}
_LEAVES = (type(None), bool, int, float, str, bytes)
#: tensor dtypes whose ``numpy()`` is a C-contiguous view of the same bytes (bf16 and friends have none)
_AS_NUMPY = frozenset(("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool",
                       "complex64", "complex128"))

_NUMPY_SCALARS = frozenset(d.type for d in NUMPY_DTYPES.values())

_plain = msgspec.msgpack.Encoder()
#: most sizes in a stored shape (torch's own limit is 64 dimensions)
MAX_DIMS = 64
#: deepest nesting of containers a stored state may have (a state dict nests a few levels)
MAX_DEPTH = 64
_Size = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Shape = Annotated[list[_Size], msgspec.Meta(max_length=MAX_DIMS)]
#: a tensor's fields: dtype name, shape, offset and size of its bytes in the data section
_tensor_fields = msgspec.msgpack.Decoder(tuple[str, _Shape, _Size, _Size])
#: a NumPy value's: the same, its shape None for a scalar
_numpy_fields = msgspec.msgpack.Decoder(tuple[str, Optional[_Shape], _Size, _Size])
_encoder = msgspec.msgpack.Encoder()
_LENGTH = 8  # bytes of the tree's length


class _Unsupported(Exception):
    pass


class _Packer:
    """Builds the msgpack-able tree of one state and collects its tensors' bytes (uncopied views)."""

    def __init__(self) -> None:
        self.section: list[Any] = []  # buffers (NumPy views of the tensors' storage), in offset order
        self.offset = 0

    def tensor(self, t: Tensor) -> msgspec.msgpack.Ext:
        name = _NAMES.get(t.dtype)
        if name is None or t.layout != torch.strided or t.is_quantized or t.is_meta:
            raise _Unsupported
        raw = None
        if t.device.type == "cpu" and name in _AS_NUMPY and t.is_contiguous():
            try:  # the usual state tensor: its memory as it is (the same bytes as the general path's view)
                raw = t.numpy()
            except RuntimeError:  # it requires grad, or has its conjugate or negative bit set
                pass
        if raw is None:
            flat = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy()
        # a view of the tensor's memory: copied once, by encode_state's join
        offset, nbytes = self._section(raw)
        return msgspec.msgpack.Ext(_TENSOR, _plain.encode([name, list(t.shape), offset, nbytes]))

    def _section(self, raw: Any) -> tuple[int, int]:
        """Put ``raw`` (a buffer) in the data section; return (its offset, its size)."""
        offset, nbytes = self.offset, memoryview(raw).nbytes
        self.section.append(raw)
        self.offset += nbytes
        return offset, nbytes

    def numpy(self, obj: np.generic | np.ndarray) -> msgspec.msgpack.Ext:
        dtype = obj.dtype
        if NUMPY_DTYPES.get(dtype.name) != dtype:  # also refuses a non-native byte order
            raise _Unsupported
        shape = list(obj.shape) if isinstance(obj, np.ndarray) else None
        offset, nbytes = self._section(np.ascontiguousarray(obj).reshape(-1).view(np.uint8))
        return msgspec.msgpack.Ext(_NUMPY, _plain.encode([dtype.name, shape, offset, nbytes]))

    def pack(self, obj: Any) -> Any:
        """``obj`` as msgpack-able values (a container's leaves are taken as they are, no call each)."""
        t = type(obj)
        if t in _LEAVES:
            return obj
        if t is Tensor:
            return self.tensor(obj)
        if t is dict or t is OrderedDict:
            items = {}
            for k, v in obj.items():
                if type(k) is not str and type(k) is not int:
                    raise _Unsupported
                items[k] = v if type(v) in _LEAVES else self.pack(v)
            metadata = getattr(obj, "_metadata", None)
            if metadata is None:
                return items
            return msgspec.msgpack.Ext(_STATE_DICT, _encoder.encode([items, self.pack(dict(metadata))]))
        if t is list or t is tuple:
            values = [v if type(v) in _LEAVES else self.pack(v) for v in obj]
            return values if t is list else msgspec.msgpack.Ext(_TUPLE, _encoder.encode(values))
        if isinstance(obj, (np.generic, np.ndarray)) and (t is np.ndarray or t in _NUMPY_SCALARS):
            return self.numpy(obj)
        raise _Unsupported


def encode_state(state: Any) -> bytes | None:
    """``state`` (a state dict) as ``"tensors"`` codec bytes, or ``None`` when the codec cannot
    hold it exactly (see the module docstring; the caller then uses ``torch.save``)."""
    packer = _Packer()
    try:
        tree = _encoder.encode(packer.pack(state))
    except (_Unsupported, OverflowError, TypeError):
        return None
    return b"".join([len(tree).to_bytes(_LENGTH, "little"), tree, *packer.section])


def decode_state(data: bytes) -> Any:
    """The state :func:`encode_state` encoded (tensors on the CPU, writable, not sharing memory).

    The bytes are someone else's (a run directory handed over): everything is checked before it is
    built -- each extension's fields by type (a dtype of :data:`DTYPES` / :data:`NUMPY_DTYPES`, a
    shape of at most :data:`MAX_DIMS` sizes in ``[0, 2^63)``, an offset and size inside the data
    section that match the shape), nesting at most :data:`MAX_DEPTH` containers deep, map keys
    ``str`` or ``int``, bool bytes 0 or 1 -- so crafted bytes raise ``ValueError``, never another
    error, and never allocate more than the bytes given.

    Raises:
        ValueError: the bytes do not decode (torn, crafted, or not this codec), naming what is wrong.
    """
    view = memoryview(data)
    if len(view) < _LENGTH:
        raise ValueError(f"{len(view)} bytes hold no tree length ({_LENGTH} bytes)")
    n = int.from_bytes(view[:_LENGTH], "little")
    if _LENGTH + n > len(view):
        raise ValueError(f"the tree's length {n} does not fit in {len(view)} bytes")
    section = view[_LENGTH + n:]

    def raw(kind: str, name: str, shape: list[int], itemsize: int, offset: int, nbytes: int) -> memoryview:
        numel = 1
        for d in shape:
            numel *= d
        if nbytes != numel * itemsize or offset + nbytes > len(section):
            raise ValueError(f"a {name} {kind} of shape {shape} needs {numel * itemsize} bytes; "
                             f"{nbytes} at offset {offset} of a {len(section)}-byte data section")
        data = section[offset:offset + nbytes]
        if name in ("bool", "bool_") and data.tobytes().translate(None, b"\x00\x01"):
            raise ValueError(f"a bool {kind} holds a byte other than 0 or 1")
        return data

    def fields(decoder: msgspec.msgpack.Decoder[Any], payload: memoryview, kind: str) -> Any:
        try:
            return decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise ValueError(f"a {kind}'s fields do not decode: {exc}") from None

    def ext_hook(code: int, payload: memoryview) -> Any:
        if code == _TENSOR:
            name, shape, offset, nbytes = fields(_tensor_fields, payload, "tensor")
            dtype = DTYPES.get(name)
            if dtype is None:
                raise ValueError(f"unknown tensor dtype {name!r}")
            data = raw("tensor", name, shape, dtype.itemsize, offset, nbytes)
            try:
                if not nbytes:
                    return torch.empty(shape, dtype=dtype)
                return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
            except RuntimeError as exc:  # e.g. an empty tensor whose sizes overflow its strides
                raise ValueError(f"a {name} tensor of shape {shape} cannot be built: {exc}") from None
        if code == _NUMPY:
            name, shape, offset, nbytes = fields(_numpy_fields, payload, "NumPy value")
            np_dtype = NUMPY_DTYPES.get(name)
            if np_dtype is None:
                raise ValueError(f"unknown NumPy dtype {name!r}")
            data = raw("NumPy value", name, shape if shape is not None else [], np_dtype.itemsize, offset, nbytes)
            array = np.frombuffer(bytearray(data), dtype=np_dtype)
            return array.reshape(shape) if shape is not None else array[0]
        if code == _TUPLE:
            items = nested(payload)
            if type(items) is not list:
                raise ValueError(f"a tuple holds a {type(items).__name__}, not an array of items")
            return tuple(items)
        if code == _STATE_DICT:
            pair = nested(payload)
            if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not dict or type(pair[1]) is not dict:
                raise ValueError("a state dict is not [items map, metadata map]")
            if not all(type(v) is dict for v in pair[1].values()):  # nn.Module reads each as a map
                raise ValueError("a state dict's metadata is not a map of maps (module prefix -> version fields)")
            out = OrderedDict(pair[0])
            out._metadata = pair[1]  # type: ignore[attr-defined]
            return out
        raise ValueError(f"unknown msgpack extension type {code}")

    depth = [0]

    def nested(payload: memoryview) -> Any:
        depth[0] += 1
        try:
            if depth[0] > MAX_DEPTH:
                raise ValueError(f"containers nest more than {MAX_DEPTH} deep")
            return decoder.decode(payload)
        finally:
            depth[0] -= 1

    decoder = msgspec.msgpack.Decoder(ext_hook=ext_hook)
    try:
        tree = decoder.decode(view[_LENGTH:_LENGTH + n])
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
    except RecursionError:
        raise ValueError(f"containers nest deeper than this interpreter decodes (at most {MAX_DEPTH} are "
                         "expected)") from None
    _check_tree(tree)
    return tree


def _check_tree(tree: Any) -> None:
    """Refuse a decoded tree nested more than :data:`MAX_DEPTH` deep or holding a map key that is not
    ``str``/``int`` (what :func:`encode_state` writes), without recursion.

    Raises:
        ValueError: naming the depth or the key's type.
    """
    stack = [(tree, 0)]
    while stack:
        node, level = stack.pop()
        if level > MAX_DEPTH:
            raise ValueError(f"containers nest more than {MAX_DEPTH} deep")
        if isinstance(node, dict):
            for k, v in node.items():
                if type(k) is not str and type(k) is not int:
                    raise ValueError(f"a map key is a {type(k).__name__}, not a str or int")
                stack.append((v, level + 1))
            metadata = getattr(node, "_metadata", None)
            if metadata is not None:
                stack.append((metadata, level + 1))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, level + 1) for v in node)
