"""Checkpoints: a msgspec manifest naming content-addressed component blobs.

A component is stored with one of three codecs:

* ``"tensors"``: a state dict as msgpack with raw tensor bytes
  (:mod:`nnx_es.state_codec`; format 3) -- what model, optimizer, scheduler and
  scaler states use when it can hold them exactly;
* ``"torch"``: ``torch.save`` bytes of a state dict ``"tensors"`` cannot hold,
  loaded back only with ``torch.load(weights_only=True)`` (tensors and plain
  containers; a pickle that would import or call anything is refused);
* ``"msgpack"``: everything else (counters, RNG streams, callback states).

Nothing is unpickled on load, except by that safe loader. Component names: ``model``,
``optimizer/<name>``, ``scheduler/<name>``, ``rng``, ``counters``,
``monitor``, ``callback/<name>``, ``topology``.

A ``"msgpack"`` or ``"tensors"`` component of at most :data:`INLINE_MAX` bytes
(RNG streams, monitor, schedulers, topology, small callback states, a small
model and its optimizer) is kept inside the manifest (``Component.data``)
instead of a blob file of its own: the manifest's hash covers it, its ``blob``
is still the SHA-256 of its bytes (verified on load). A training run keeps
its manifests in the event log (``BlobStore.stage``), written in LAST's own
synced transaction: a commit of a small model fsyncs the log once and writes
no file; components above the limit are blob files, durable before LAST.
Manifests of formats 1 (every component a blob) and 2 (``"torch"`` state
dicts, inline msgpack up to 64 KiB) load unchanged.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any

import msgspec

from events.schema import Counters
from nnx_es.errors import CorruptCheckpointError, UnsafePayloadError
from nnx_es.storage import BlobStore

__all__ = [
    "Component",
    "component_bytes",
    "encode_checkpoint",
    "Manifest",
    "load_component",
    "read_manifest",
    "torch_bytes",
    "verify_checkpoint",
    "write_checkpoint",
]

MANIFEST_FORMAT = 3

#: msgpack and tensors components up to this many bytes are kept inside the manifest.
INLINE_MAX = 256 * 1024

_Payload = bytes  # the field ``bytes`` below shadows the builtin inside the class body


class Component(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One component: the SHA-256 of its bytes, its codec (``"tensors"`` | ``"torch"`` |
    ``"msgpack"``), its size, and -- for a small component kept inline -- the bytes themselves."""

    blob: str
    codec: str
    bytes: int
    data: _Payload | None = None


class Manifest(msgspec.Struct, frozen=True, kw_only=True, tag="nnx_es.manifest"):
    """What one checkpoint holds. epoch: 0-based last epoch in it (-1: before training)."""

    format: int = MANIFEST_FORMAT
    run_id: str
    epoch: int
    step: int
    counters: Counters
    components: dict[str, Component]
    world_size: int = 1


_manifest_decoder = msgspec.msgpack.Decoder(Manifest)
_any_decoder = msgspec.msgpack.Decoder()


def torch_bytes(obj: Any) -> bytes:
    """``torch.save`` ``obj`` (a state dict) to bytes."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_checkpoint(store: BlobStore, **fields: Any) -> tuple[str, Manifest]:
    """Store every part, then the manifest naming them, as files; return (manifest hash, manifest).

    ``fields``: the keyword arguments of :func:`encode_checkpoint`. Everything is durable when
    this returns (a run stores its manifests in its log instead: see ``nnx_es.runtime.commit``).

    Raises:
        CheckpointWriteError: a blob could not be written durably.
    """
    digest, manifest, data = encode_checkpoint(store, **fields)
    store.put_all([data], [digest])  # data's hash: not computed again
    return digest, manifest


def encode_checkpoint(
    store: BlobStore,
    *,
    run_id: str,
    epoch: int,
    step: int,
    counters: Counters,
    parts: dict[str, tuple[str, bytes]],
    world_size: int = 1,
) -> tuple[str, Manifest, bytes]:
    """Store the parts too big to be inline as blob files (durable when this returns) and encode
    the manifest naming every part; return (manifest hash, manifest, manifest bytes).

    The manifest itself is not stored: the caller stores it (``store.stage`` before LAST).

    Raises:
        CheckpointWriteError: a blob could not be written durably.
    """
    blobs: list[bytes] = []
    digests: list[str] = []
    components = {}
    for name, (codec, data) in parts.items():
        inline = codec != "torch" and len(data) <= INLINE_MAX
        digest = hashlib.sha256(data).hexdigest()
        if not inline:
            blobs.append(data)
            digests.append(digest)
        components[name] = Component(blob=digest, codec=codec, bytes=len(data), data=data if inline else None)
    manifest = Manifest(
        run_id=run_id, epoch=epoch, step=step, counters=counters, components=components, world_size=world_size
    )
    if blobs:  # one batch: one directory fsync for all of them
        store.put_all(blobs, digests)  # hashed above: not again
    data = msgspec.msgpack.encode(manifest)
    return hashlib.sha256(data).hexdigest(), manifest, data


def read_manifest(store: BlobStore, digest: str) -> Manifest:
    """Read, hash-verify and decode a manifest.

    Raises:
        CorruptCheckpointError: missing, empty, hash mismatch, or not a manifest (torn).
    """
    data = store.get(digest)
    if not data:
        raise CorruptCheckpointError(f"manifest {digest} is empty")
    try:
        return _manifest_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptCheckpointError(f"manifest {digest} is torn or not a manifest: {exc}") from None


def verify_checkpoint(store: BlobStore, digest: str, *, run_id: str | None = None) -> Manifest:
    """Verify a manifest and every blob it names (SHA-256), before anything is restored.

    Raises:
        CorruptCheckpointError: the manifest or a blob is missing, empty, torn or
            corrupt, or (with ``run_id``) the manifest belongs to another run (mixed).
    """
    manifest = read_manifest(store, digest)
    if run_id is not None and manifest.run_id != run_id:
        raise CorruptCheckpointError(
            f"manifest {digest} is mixed: it belongs to run {manifest.run_id!r}, not {run_id!r}"
        )
    for name, comp in manifest.components.items():
        data = component_bytes(store, name, comp)
        if len(data) != comp.bytes:
            raise CorruptCheckpointError(f"component {name!r} blob {comp.blob} has {len(data)} bytes, expected {comp.bytes}")
    return manifest


def component_bytes(store: BlobStore, name: str, comp: Component) -> bytes:
    """A component's bytes, from the manifest (inline) or its blob, hash-verified either way.

    Raises:
        UnsafePathError: the blob file is a symbolic link, a FIFO, a device, ... (nothing was read).
        CorruptCheckpointError: the blob is missing, corrupt or longer than ``comp.bytes``, or inline
            bytes do not hash to ``blob``.
    """
    if comp.data is None:
        return store.get(comp.blob, size=comp.bytes)  # never read past the size the manifest records
    found = hashlib.sha256(comp.data).hexdigest()
    if found != comp.blob:
        raise CorruptCheckpointError(f"component {name!r} kept in the manifest is corrupt: its bytes hash to "
                                     f"{found}, not {comp.blob}")
    return comp.data


def load_component(store: BlobStore, manifest: Manifest, name: str) -> Any:
    """Load one component safely (the tensors codec, msgpack, or a ``weights_only`` torch load).

    Raises:
        KeyError: the manifest has no such component.
        UnsafePayloadError: a torch blob holds a pickle the safe loader refuses.
        CorruptCheckpointError: the blob is missing, corrupt or does not decode.
    """
    comp = manifest.components[name]
    data = component_bytes(store, name, comp)
    if comp.codec == "msgpack":
        try:
            return _any_decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise CorruptCheckpointError(f"component {name!r} does not decode: {exc}") from None
    if comp.codec == "tensors":
        from nnx_es.state_codec import decode_state  # here, so reading a run's manifests needs no torch

        try:
            return decode_state(data)
        except ValueError as exc:
            raise CorruptCheckpointError(f"component {name!r} does not decode: {exc}") from None
    if comp.codec == "torch":
        import torch  # here, so reading a run's manifests needs no torch

        try:
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as exc:
            raise UnsafePayloadError(
                f"component {name!r} (blob {comp.blob}) holds a payload the safe loader refuses: {exc}"
            ) from None
        except Exception as exc:
            raise CorruptCheckpointError(f"component {name!r} does not load: {type(exc).__name__}: {exc}") from None
    raise CorruptCheckpointError(f"component {name!r} has unknown codec {comp.codec!r}")
