"""The floor contender of ``make bench`` keeps exactly the records it claims, no fewer and no more: one
keeping fewer would understate what the records cost, one keeping more would make the like-for-like
target look out of reach when it is not."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sklearn")

from bench.overhead import digits_loader, run_floor  # noqa: E402
from events.log import LmdbLog  # noqa: E402
from nnx_es.checkpoint import load_component, verify_checkpoint  # noqa: E402
from nnx_es.storage import BlobStore  # noqa: E402


def _kinds(root: Path) -> list[tuple[str, object]]:
    with LmdbLog(root / "events.lmdb", readonly=True) as log:
        return [(type(e).KIND, e) for _, e in log.read()]


def test_the_floor_records_two_events_a_microbatch_and_a_verified_checkpoint_an_epoch(tmp_path: Path) -> None:
    run_floor(2, keep=tmp_path)
    events = _kinds(tmp_path)
    per_epoch = len(digits_loader())
    kinds = [k for k, _ in events]
    assert set(kinds) == {"microbatch_done", "update_committed", "checkpoint_stored", "last_committed"}  # no more
    assert kinds.count("microbatch_done") == kinds.count("update_committed") == 2 * per_epoch
    assert kinds.count("checkpoint_stored") == 2
    lasts = [e for k, e in events if k == "last_committed"]
    assert [e.epoch for e in lasts] == [0, 1] and kinds[-1] == "last_committed"
    assert lasts[-1].step == 2 * per_epoch
    store = BlobStore(tmp_path / "blobs")
    manifest = verify_checkpoint(store, lasts[-1].manifest)  # every part hashes to its name
    model = load_component(store, manifest, "model")
    assert set(model) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    losses = [e.loss for k, e in events if k == "microbatch_done"]
    assert len(set(losses)) > per_epoch  # the losses read on the host, not a placeholder


def test_recording_alone_keeps_the_events_and_no_checkpoint(tmp_path: Path) -> None:
    run_floor(1, whole=False, keep=tmp_path)
    kinds = [k for k, _ in _kinds(tmp_path)]
    assert kinds.count("microbatch_done") == kinds.count("update_committed") == len(digits_loader())
    assert set(kinds) == {"microbatch_done", "update_committed"}
