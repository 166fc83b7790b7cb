"""Step receipts (spec 003 StepReceipt, issue 13): every window's accounting in the log.

``update_committed`` and ``update_skipped`` carry local and global examples, microbatches,
accumulation steps, data-parallel size and collective bytes; in one process global equals
local, the data-parallel size is 1 and no collective moves a byte. The data-parallel seam
(``UpdateEngine.window.global_den`` / ``collective_bytes``) is exercised directly: what the DDP
path sets is what the receipt says, and the window is divided by the global denominator.
Expected values are counted from the data here, never read from a previous run.
"""

from __future__ import annotations

import copy

import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from events.codec import decode, encode
from events.schema import UpdateCommitted, UpdateSkipped
from nnx_es import Trainer
from trainkit import batches, of_kind, params_of, small_net

LR = 0.1


def _trainer(tmp_path, net, **kw) -> Trainer:
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=LR), nn.CrossEntropyLoss(),
                   runs_root=tmp_path / "runs", run_id="r", progress=False, **kw)


def test_one_process_receipts_count_local_equal_global_and_a_short_last_window(tmp_path):
    sizes = [5, 7, 2, 4, 3]  # accumulation 2: windows [5, 7], [2, 4], then a short [3]
    data = batches(sizes, seed=2)
    run = _trainer(tmp_path, small_net(2), accumulation=2).fit(data, None, epochs=1)

    assert run.status == "completed"
    receipts = of_kind(run.run_dir, "update_committed")
    windows = [sizes[0:2], sizes[2:4], sizes[4:]]
    assert [r.microbatches for r in receipts] == [len(w) for w in windows]
    assert [r.local_examples for r in receipts] == [float(sum(w)) for w in windows]
    assert [r.global_examples for r in receipts] == [r.local_examples for r in receipts]
    assert {(r.accumulation_steps, r.data_parallel_size, r.collective_bytes, r.skipped) for r in receipts} == {
        (2, 1, 0, False)
    }


def test_a_skipped_window_carries_the_same_accounting(tmp_path):
    data = batches([4, 4, 3, 3], seed=1, masks={2: [0.0] * 3, 3: [0.0] * 3})  # window 2: every row masked
    run = _trainer(tmp_path, small_net(3), accumulation=2, sample_weights=True).fit(data, None, epochs=1)

    (skip,) = of_kind(run.run_dir, "update_skipped")
    assert skip.reason == "masked"
    assert (skip.microbatches, skip.local_examples, skip.global_examples) == (2, 0.0, 0.0)
    assert (skip.accumulation_steps, skip.data_parallel_size, skip.collective_bytes) == (2, 1, 0)
    (receipt,) = of_kind(run.run_dir, "update_committed")
    assert (receipt.local_examples, receipt.microbatches) == (8.0, 2)


def _engine_run(tmp_path, net, sizes, *, global_den=None, nbytes=0):
    """Microbatches of ``sizes`` through one Trainer's engine; the seam is set before each window's end."""
    trainer = _trainer(tmp_path, net, accumulation=len(sizes))
    engine = trainer.engine
    if global_den is not None:
        original = engine.update

        def finalize(ctx):
            engine.window.global_den = global_den
            engine.window.collective_bytes += nbytes
            return original(ctx)

        engine.update = finalize
    return trainer.fit(batches(sizes, seed=5), None, epochs=1)


def test_the_data_parallel_seam_sets_global_examples_bytes_and_the_divisor(tmp_path):
    sizes = [3, 5]
    net, ref = small_net(6), small_net(6)
    run = _engine_run(tmp_path, net, sizes, global_den=20.0, nbytes=4096)

    (receipt,) = of_kind(run.run_dir, "update_committed")
    assert (receipt.local_examples, receipt.global_examples, receipt.collective_bytes) == (8.0, 20.0, 4096)
    # the window's gradient is its numerator divided by the global W, as DDP's "grad x world / W" makes it
    data = batches(sizes, seed=5)
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    (F.cross_entropy(ref(x), y, reduction="sum") / 20.0).backward()
    opt.step()
    got, want = params_of(net), params_of(ref)
    assert all(torch.allclose(got[k], want[k], atol=1e-6, rtol=0) for k in want)
    assert receipt.loss == pytest.approx(
        float(F.cross_entropy(small_net(6)(x), y, reduction="sum").detach()) / 20.0, abs=1e-6
    )


def test_the_seam_resets_each_window(tmp_path):
    trainer = _trainer(tmp_path, small_net(1), accumulation=1)
    engine = trainer.engine
    original = engine.update
    calls = []

    def finalize(ctx):
        if not calls:  # only the first window is told of bytes and a global count
            engine.window.global_den = engine.window.den * 2
            engine.window.collective_bytes += 100
        calls.append(1)
        return original(ctx)

    engine.update = finalize
    run = trainer.fit(batches([4, 4], seed=1), None, epochs=1)
    first, second = of_kind(run.run_dir, "update_committed")
    assert (first.global_examples, first.collective_bytes) == (8.0, 100)
    assert (second.global_examples, second.collective_bytes) == (4.0, 0)


def test_a_receipt_recorded_before_the_new_fields_decodes_as_one_process():
    full = msgspec.msgpack.decode(
        encode(UpdateCommitted(step=1, epoch=0, microbatches=1, local_examples=8.0, global_examples=8.0, loss=0.1))
    )
    for f in ("accumulation_steps", "collective_bytes", "skipped"):
        del full[f]
    event = decode(msgspec.msgpack.encode(full))
    assert isinstance(event, UpdateCommitted)
    assert (event.accumulation_steps, event.collective_bytes, event.skipped) == (1, 0, False)

    old_skip = {"kind": "update_skipped", "step": 0, "epoch": 0, "microbatches": 2, "reason": "masked"}
    skip = decode(msgspec.msgpack.encode(old_skip))
    assert isinstance(skip, UpdateSkipped)
    assert (skip.local_examples, skip.global_examples, skip.data_parallel_size, skip.collective_bytes) == (
        0.0, 0.0, 1, 0)


def test_a_v1_receipt_upcasts_with_the_receipt_defaults():
    old = {"kind": "update_committed", "step": 3, "epoch": 1, "microbatches": 2, "examples": 16.0,
           "loss": 0.5, "lr": 0.1}
    event = decode(msgspec.msgpack.encode(old))
    assert isinstance(event, UpdateCommitted) and copy.copy(event.lrs) == [0.1]
    assert (event.local_examples, event.global_examples, event.accumulation_steps, event.collective_bytes) == (
        16.0, 16.0, 1, 0)
