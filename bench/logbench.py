"""Benchmarks 2 and 3: event append cost, fsyncs per epoch, and replay throughput."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from events.log import LmdbLog
from events.schema import Counters, EpochBegan, LastCommitted, MicrobatchDone, UpdateCommitted
from nnx_es.lifecycle import Lifecycle
from nnx_es.recorder import Recorder
from projections.view import project

__all__ = ["append_us_per_event", "fsyncs_per_epoch", "replay_events_per_s", "synthetic_log"]


def _epoch_events(epoch: int, batches: int, step0: int) -> list:
    out: list = [EpochBegan(epoch=epoch)]
    for b in range(batches):
        out.append(MicrobatchDone(epoch=epoch, batch=b, rows=32, examples=32.0, loss=0.5))
        out.append(UpdateCommitted(step=step0 + b + 1, epoch=epoch, microbatches=1, local_examples=32.0,
                                   global_examples=32.0, loss=0.5, grad_norm=1.0, lrs=[1e-3], optimizer="adam"))
    return out


def append_us_per_event(n_epochs: int = 40, batches: int = 250) -> float:
    """Amortized µs per event through the runtime's recorder (machine check, counters fold,
    encode, buffer) with one LMDB transaction per epoch, as the trainer flushes."""
    root = Path(tempfile.mkdtemp(prefix="nnx_bench_log_"))
    try:
        events = [_epoch_events(e, batches, e * batches) for e in range(n_epochs)]
        with LmdbLog(root / "events.lmdb") as log:
            rec = Recorder(log, Lifecycle("committed"))
            t0 = time.perf_counter()
            n = 0
            for epoch_events in events:
                rec.lifecycle.state = "committed"
                for ev in epoch_events:
                    rec.emit(ev)
                n += len(epoch_events)
                log.flush()
            return (time.perf_counter() - t0) / n * 1e6
    finally:
        shutil.rmtree(root, ignore_errors=True)


def fsyncs_per_epoch(epochs: int = 6, lag: int | str = "epoch") -> tuple[float, float]:
    """Count (not guess) fsyncs while nnx_es trains the digits MLP, in steady state.

    Counted from the start of epoch 1 to the start of the last epoch (the run's
    initial and final LAST commits are outside the window). Returns
    (fsyncs per epoch on all threads, fsyncs per epoch on the training thread).
    """
    import threading

    import torch
    from torch import nn

    from bench.overhead import digits_loader, make_net
    from nnx_es import LambdaCallback, Trainer

    counts = {"all": 0, "main": 0}
    marks: dict[int, tuple[int, int]] = {}
    main = threading.main_thread()
    real_fsync = os.fsync
    real_flush = LmdbLog.flush

    def counting_fsync(fd: int) -> None:
        counts["all"] += 1
        counts["main"] += threading.current_thread() is main
        real_fsync(fd)

    def counting_flush(self: LmdbLog, *, sync: bool = False) -> None:
        if sync:
            counts["all"] += 1
            counts["main"] += threading.current_thread() is main
        real_flush(self, sync=sync)

    mark = LambdaCallback(on_epoch_begin=lambda ctx: marks.__setitem__(ctx.epoch, (counts["all"], counts["main"])))
    root = Path(tempfile.mkdtemp(prefix="nnx_bench_fsync_"))
    os.fsync = counting_fsync  # type: ignore[assignment]
    LmdbLog.flush = counting_flush  # type: ignore[method-assign]
    try:
        net = make_net()
        trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=1e-3), nn.CrossEntropyLoss(),
                          callbacks=[mark], runs_root=root, run_id="fsync", progress=False, checkpoint_lag=lag)
        trainer.fit(digits_loader(), epochs=epochs)
    finally:
        os.fsync = real_fsync  # type: ignore[assignment]
        LmdbLog.flush = real_flush  # type: ignore[method-assign]
        shutil.rmtree(root, ignore_errors=True)
    (a0, m0), (a1, m1) = marks[1], marks[epochs - 1]
    n = epochs - 2
    return (a1 - a0) / n, (m1 - m0) / n


def synthetic_log(path: Path, n_events: int, batches: int = 250) -> int:
    """Write a realistic committed log of about ``n_events`` events; return the count."""
    with LmdbLog(path) as log:
        step = 0
        epoch = 0
        while log.next_seq < n_events:
            for ev in _epoch_events(epoch, batches, step):
                log.append(ev)
            step += batches
            log.append(LastCommitted(manifest="0" * 64, epoch=epoch, step=step,
                                     counters=Counters(batch=step, step=step, global_step=step, epoch=epoch + 1)))
            log.flush()
            epoch += 1
        return log.next_seq


def replay_events_per_s(n_events: int = 500_000) -> float:
    """Events per second to rebuild every projection from an LMDB log (read, decode, committed view, fold)."""
    root = Path(tempfile.mkdtemp(prefix="nnx_bench_replay_"))
    try:
        n = synthetic_log(root / "events.lmdb", n_events)
        with LmdbLog(root / "events.lmdb", readonly=True) as log:
            t0 = time.perf_counter()
            p = project(log.read())
            dt = time.perf_counter() - t0
        assert p.counters.step > 0
        return n / dt
    finally:
        shutil.rmtree(root, ignore_errors=True)
