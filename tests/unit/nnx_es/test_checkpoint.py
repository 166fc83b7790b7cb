"""Checkpoints: manifest + content-addressed blobs, verified before restore, loaded without unpickling code."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from events import Counters
from nnx_es.checkpoint import (
    INLINE_MAX,
    Component,
    Manifest,
    load_component,
    read_manifest,
    torch_bytes,
    verify_checkpoint,
    write_checkpoint,
)
from nnx_es.errors import CorruptCheckpointError, UnsafePayloadError
from nnx_es.storage import BlobStore

COUNTERS = Counters(batch=40, step=20, global_step=20, epoch=2, epoch_step=20)


def _state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "fc.weight": torch.randn(4, 3, generator=gen),
        "fc.bias": torch.randn(4, generator=gen),
        "bn.num_batches_tracked": torch.tensor(7, dtype=torch.int64),
    }


def _write(store: BlobStore, run_id: str = "run-1", **extra: tuple[str, bytes]) -> tuple[str, Manifest]:
    parts: dict[str, tuple[str, bytes]] = {
        "model": ("torch", torch_bytes(_state_dict())),
        "counters": ("msgpack", msgspec.msgpack.encode({"step": 20, "epoch": 2, "lrs": [0.1, 0.01]})),
        **extra,
    }
    return write_checkpoint(store, run_id=run_id, epoch=1, step=20, counters=COUNTERS, parts=parts)


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def _refused(store: BlobStore, digest: str, *words: str, run_id: str | None = None) -> None:
    with pytest.raises(CorruptCheckpointError) as info:
        verify_checkpoint(store, digest, run_id=run_id)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in msg, f"{word!r} not in {msg!r}"


# --- round trip --------------------------------------------------------------------------


def test_write_verify_load_round_trip(store: BlobStore) -> None:
    digest, manifest = _write(store)
    verified = verify_checkpoint(store, digest, run_id="run-1")
    assert verified == manifest == read_manifest(store, digest)
    assert (verified.run_id, verified.epoch, verified.step, verified.counters) == ("run-1", 1, 20, COUNTERS)
    assert set(verified.components) == {"model", "counters"}
    assert verified.components["model"].codec == "torch"

    model = load_component(store, verified, "model")
    expected = _state_dict()
    assert set(model) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(model[key], tensor) and model[key].dtype == tensor.dtype
    assert load_component(store, verified, "counters") == {"step": 20, "epoch": 2, "lrs": [0.1, 0.01]}
    with pytest.raises(KeyError):
        load_component(store, verified, "optimizer/default")


def test_identical_state_costs_nothing_twice(store: BlobStore) -> None:
    first, m1 = _write(store)
    second, m2 = _write(store)
    assert first == second
    assert m1.components["model"].blob == m2.components["model"].blob
    files = [p for p in store.root.rglob("*") if p.is_file()]
    assert len(files) == 2  # model, manifest (the small counters component is kept in the manifest)


def test_small_msgpack_components_live_in_the_manifest_and_big_ones_in_blobs(store: BlobStore) -> None:
    big = msgspec.msgpack.encode(list(range(INLINE_MAX)))
    assert len(big) > INLINE_MAX
    digest, manifest = _write(store, big=("msgpack", big))
    small = manifest.components["counters"]
    assert small.data is not None and small.blob == hashlib.sha256(small.data).hexdigest()
    assert not store.exists(small.blob)
    assert manifest.components["big"].data is None and store.get(manifest.components["big"].blob) == big
    assert manifest.components["model"].data is None
    verified = verify_checkpoint(store, digest, run_id="run-1")
    assert load_component(store, verified, "big") == list(range(INLINE_MAX))
    assert load_component(store, verified, "counters") == {"step": 20, "epoch": 2, "lrs": [0.1, 0.01]}


def test_each_part_is_hashed_once_per_checkpoint(store: BlobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large part's SHA-256 names it in the manifest and as a file: computed once, not again by the
    store (a 13 MB state hashed twice cost a commit ~6 ms of its ~24 on the wide benchmark)."""
    big = msgspec.msgpack.encode(list(range(INLINE_MAX)))
    real = hashlib.sha256
    hashed: list[int] = []

    def counting(data: bytes = b"", *args: Any, **kwargs: Any) -> Any:
        hashed.append(len(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(hashlib, "sha256", counting)
    digest, manifest = _write(store, big=("msgpack", big))
    monkeypatch.setattr(hashlib, "sha256", real)
    assert sorted(hashed).count(len(big)) == 1
    assert len(hashed) == len(manifest.components) + 1  # each part, and the manifest
    assert store.get(manifest.components["big"].blob) == big  # the file is named by that one hash
    assert verify_checkpoint(store, digest, run_id="run-1").components == manifest.components


def test_a_format_1_manifest_with_every_component_in_a_blob_still_loads(store: BlobStore) -> None:
    rng = msgspec.msgpack.encode({"seed": 3})
    old = Manifest(format=1, run_id="run-1", epoch=0, step=0, counters=Counters(),
                   components={"rng": Component(blob=store.put(rng), codec="msgpack", bytes=len(rng))})
    digest = store.put(msgspec.msgpack.encode(old))
    assert load_component(store, verify_checkpoint(store, digest), "rng") == {"seed": 3}


def test_an_inline_component_whose_bytes_do_not_hash_to_its_name_is_refused(store: BlobStore) -> None:
    good = msgspec.msgpack.encode({"seed": 3})
    forged = Manifest(run_id="run-1", epoch=0, step=0, counters=Counters(), components={
        "rng": Component(blob=hashlib.sha256(good).hexdigest(), codec="msgpack", bytes=len(good),
                         data=msgspec.msgpack.encode({"seed": 4}))})
    digest = store.put(msgspec.msgpack.encode(forged))
    _refused(store, digest, "'rng'", "corrupt")
    with pytest.raises(CorruptCheckpointError, match="rng"):
        load_component(store, forged, "rng")


# --- refusals ----------------------------------------------------------------------------


def test_missing_manifest_is_refused(store: BlobStore) -> None:
    digest, _ = _write(store)
    store.path(digest).unlink()
    _refused(store, digest, digest, "missing")


def test_empty_manifest_is_refused(store: BlobStore) -> None:
    empty = store.put(b"")
    _refused(store, empty, empty, "empty")


@pytest.mark.parametrize("keep", [1, 10, 0.5, -1])
def test_torn_manifest_is_refused(store: BlobStore, keep: float) -> None:
    digest, _ = _write(store)
    whole = store.get(digest)
    n = int(len(whole) * keep) if isinstance(keep, float) else keep
    torn = store.put(whole[:n])  # a valid hash of truncated bytes
    _refused(store, torn, torn, "torn")


def test_blob_that_is_not_a_manifest_is_refused(store: BlobStore) -> None:
    other = store.put(msgspec.msgpack.encode({"kind": "something_else", "epoch": 1}))
    _refused(store, other, other, "not a manifest")


def test_component_with_a_flipped_byte_is_refused(store: BlobStore) -> None:
    digest, manifest = _write(store)
    blob = manifest.components["model"].blob
    p = store.path(blob)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    p.write_bytes(bytes(raw))
    _refused(store, digest, blob, "corrupt")
    with pytest.raises(CorruptCheckpointError):
        load_component(store, manifest, "model")


def test_missing_component_is_refused(store: BlobStore) -> None:
    digest, manifest = _write(store)
    blob = manifest.components["model"].blob
    store.path(blob).unlink()
    _refused(store, digest, blob, "missing")


def test_component_size_mismatch_is_refused(store: BlobStore) -> None:
    real = store.put(b"twelve bytes")
    lying = Manifest(
        run_id="run-1",
        epoch=0,
        step=0,
        counters=Counters(),
        components={"rng": Component(blob=real, codec="msgpack", bytes=99)},
    )
    digest = store.put(msgspec.msgpack.encode(lying))
    _refused(store, digest, "rng", "99")


def test_manifest_of_another_run_is_refused_as_mixed(store: BlobStore) -> None:
    digest, _ = _write(store, run_id="run-other")
    _refused(store, digest, "mixed", "run-other", "run-1", run_id="run-1")
    assert verify_checkpoint(store, digest).run_id == "run-other"  # no run_id: no check


# --- no code runs on load ----------------------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"echo pwned > {self.marker}",))


def _raw_pickle(marker: Path) -> bytes:
    return pickle.dumps(_Evil(marker), protocol=2)


def _torch_saved(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"weight": torch.zeros(2), "payload": _Evil(marker)}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("make", [_raw_pickle, _torch_saved], ids=["raw-pickle", "torch-save"])
def test_malicious_pickle_is_refused_and_never_runs(store: BlobStore, tmp_path: Path, make: Any) -> None:
    marker = tmp_path / "pwned"
    payload = make(marker)
    assert not marker.exists()
    blob = store.put(payload)
    manifest = Manifest(
        run_id="run-1",
        epoch=0,
        step=0,
        counters=Counters(),
        components={"model": Component(blob=blob, codec="torch", bytes=len(payload))},
    )
    digest = store.put(msgspec.msgpack.encode(manifest))
    verify_checkpoint(store, digest, run_id="run-1")  # hashes match: the payload itself is the problem
    with pytest.raises(UnsafePayloadError) as info:
        load_component(store, manifest, "model")
    assert isinstance(info.value, CorruptCheckpointError)
    assert "model" in str(info.value) and blob in str(info.value)
    assert not marker.exists(), "the pickle's command ran"


def test_malicious_pickle_really_would_run(tmp_path: Path) -> None:
    """Guards the test above: an unsafe load of the same payload does run the command."""
    marker = tmp_path / "pwned"
    pickle.loads(_raw_pickle(marker))
    assert marker.read_text().strip() == "pwned"


def test_unknown_codec_is_refused(store: BlobStore) -> None:
    blob = store.put(b"\x00")
    manifest = Manifest(
        run_id="r", epoch=0, step=0, counters=Counters(), components={"x": Component(blob=blob, codec="pickle", bytes=1)}
    )
    with pytest.raises(CorruptCheckpointError, match="pickle"):
        load_component(store, manifest, "x")
