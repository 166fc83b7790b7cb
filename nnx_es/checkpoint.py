"""Checkpoints: a msgspec manifest naming content-addressed component blobs.

A component is stored with one of two codecs:

* ``"torch"``: ``torch.save`` bytes of a state dict, loaded back only with
  ``torch.load(weights_only=True)`` (tensors and plain containers; a pickle
  that would import or call anything is refused);
* ``"msgpack"``: everything else (counters, RNG streams, callback states).

Nothing is unpickled on load. Component names: ``model``,
``optimizer/<name>``, ``scheduler/<name>``, ``rng``, ``counters``,
``monitor``, ``callback/<name>``, ``topology``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import msgspec

from events.schema import Counters
from nnx_es.errors import CorruptCheckpointError, UnsafePayloadError
from nnx_es.storage import BlobStore

__all__ = [
    "Component",
    "Manifest",
    "load_component",
    "read_manifest",
    "torch_bytes",
    "verify_checkpoint",
    "write_checkpoint",
]

MANIFEST_FORMAT = 1


class Component(msgspec.Struct, frozen=True, kw_only=True):
    blob: str
    codec: str  # "torch" | "msgpack"
    bytes: int


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


def write_checkpoint(
    store: BlobStore,
    *,
    run_id: str,
    epoch: int,
    step: int,
    counters: Counters,
    parts: dict[str, tuple[str, bytes]],
    world_size: int = 1,
) -> tuple[str, Manifest]:
    """Store every part, then the manifest naming them; return (manifest hash, manifest).

    parts: component name -> (codec, payload bytes). Blobs are durable when this returns.

    Raises:
        CheckpointWriteError: a blob could not be written durably.
    """
    components = {
        name: Component(blob=store.put(data), codec=codec, bytes=len(data)) for name, (codec, data) in parts.items()
    }
    manifest = Manifest(
        run_id=run_id, epoch=epoch, step=step, counters=counters, components=components, world_size=world_size
    )
    return store.put(msgspec.msgpack.encode(manifest)), manifest


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
        data = store.get(comp.blob)
        if len(data) != comp.bytes:
            raise CorruptCheckpointError(f"component {name!r} blob {comp.blob} has {len(data)} bytes, expected {comp.bytes}")
    return manifest


def load_component(store: BlobStore, manifest: Manifest, name: str) -> Any:
    """Load one component safely (``weights_only`` torch load, or msgpack).

    Raises:
        KeyError: the manifest has no such component.
        UnsafePayloadError: a torch blob holds a pickle the safe loader refuses.
        CorruptCheckpointError: the blob is missing, corrupt or does not decode.
    """
    comp = manifest.components[name]
    data = store.get(comp.blob)
    if comp.codec == "msgpack":
        try:
            return _any_decoder.decode(data)
        except msgspec.DecodeError as exc:
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
