"""Benchmarks 2 and 3: event append cost, fsyncs per epoch, and replay throughput; long logs for the tools."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from events.log import LmdbLog
from events.schema import (
    BestCommitted,
    CheckpointStored,
    Counters,
    EpochBegan,
    EpochSummarized,
    HistoryAppended,
    HistoryRecord,
    LastCommitted,
    MicrobatchDone,
    MonitorDecided,
    MonitorSpec,
    RunFinalized,
    RunStarted,
    SchedulerDecl,
    SchedulerStepped,
    TrainBegan,
    UpdateCommitted,
    ValidationDone,
)
from nnx_es.lifecycle import Lifecycle
from nnx_es.runtime.recording import Recorder, snapshot_folder, store_snapshot
from projections.view import project

__all__ = ["append_us_per_event", "durable_commit_ms", "fsyncs_per_epoch", "long_run_log", "replay_events_per_s",
           "synthetic_log"]


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


def durable_commit_ms(manifest_bytes: int = 120_000, reps: int = 30) -> dict[str, float]:
    """Median ms of the durable part of one epoch's commit, by the runtime's own storage calls, both ways
    a manifest can be stored: ``"in the log"`` (what a run does: ``BlobStore.stage`` then one synced
    log write holding the manifest and LAST) and ``"as a file"`` (the manifest a file of its own:
    temporary, fsync, rename, directory fsync, then the synced log write)."""
    from nnx_es.storage import BlobStore

    root = Path(tempfile.mkdtemp(prefix="nnx_bench_commit_"))
    out: dict[str, float] = {}
    try:
        with LmdbLog(root / "events.lmdb") as log:
            store = BlobStore(root / "blobs", log=log)
            for form in ("in the log", "as a file"):
                times = []
                for i in range(reps):
                    data = i.to_bytes(8, "big") + os.urandom(manifest_bytes)  # unique: never deduplicated
                    t0 = time.perf_counter()
                    store.stage(data) if form == "in the log" else store.put_all([data])
                    log.append(EpochBegan(epoch=i))
                    log.flush(sync=True)
                    times.append(time.perf_counter() - t0)
                times.sort()
                out[form] = times[len(times) // 2] * 1e3
        return out
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


def long_run_log(path: Path, n_events: int, batches: int = 2000, snapshot_every: int | None = None,
                 snapshot_cpu_s: list[float] | None = None) -> int:
    """Write the log of a long finished run of at least ``n_events`` events; return the count.

    ``snapshot_every``: also store projection snapshots as the runtime's recorder does after
    each commit (:func:`nnx_es.runtime.recording.store_snapshot`, at least that many events apart); the
    CPU seconds those calls took are appended to ``snapshot_cpu_s`` when given.

    Shaped like the trainer's: ``run_started``, ``train_began``, the opening LAST, then
    per epoch ``epoch_began``, ``batches`` pairs of ``microbatch_done`` and
    ``update_committed`` (loss and grad norm varying with the step), ``validation_done``,
    ``epoch_summarized``, ``monitor_decided``, a plateau ``scheduler_stepped``,
    ``history_appended``, ``checkpoint_stored``, ``last_committed`` covering the history
    record, ``best_committed`` when the monitor improved; the final LAST and
    ``run_finalized`` close it. No blob is stored: the audit reports every manifest missing.
    """
    epochs = max(1, math.ceil((n_events - 6) / (2 * batches + 8)))
    lr = 1e-3
    with LmdbLog(path) as log:
        folder = snapshot_folder(log, snapshot_every) if snapshot_every else None

        def commit() -> None:
            log.flush()
            if folder is not None:
                t0 = time.process_time()
                store_snapshot(log, folder)
                if snapshot_cpu_s is not None:
                    snapshot_cpu_s.append(time.process_time() - t0)

        log.append(RunStarted(run_id=Path(path).parent.name or "long", seed=0, optimizers=["adam"],
                              schedulers=[SchedulerDecl(name="plateau", clock="epoch", cls="ReduceLROnPlateau",
                                                        optimizer="adam", plateau=True)],
                              monitor=MonitorSpec(name="val_loss")))
        log.append(TrainBegan(start_epoch=0, epochs=epochs, train_batches=batches))
        manifest = f"{0:064x}"
        log.append(CheckpointStored(manifest=manifest, epoch=-1, step=0, components={"model": manifest}))
        log.append(LastCommitted(manifest=manifest, epoch=-1, step=0, counters=Counters()))
        step, best, best_epoch, bad = 0, math.inf, 0, 0
        for epoch in range(epochs):
            total = 0.0
            log.append(EpochBegan(epoch=epoch, wall_time_s=float(epoch)))
            for b in range(batches):
                step += 1
                loss = 2.0 / math.sqrt(step) + 0.05 * math.sin(step / 97.0)
                total += loss
                log.append(MicrobatchDone(epoch=epoch, batch=b, rows=32, examples=32.0, loss=loss))
                log.append(UpdateCommitted(step=step, epoch=epoch, microbatches=1, local_examples=32.0,
                                           global_examples=32.0, loss=loss, grad_norm=10 * loss, lrs=[lr],
                                           optimizer="adam"))
            val = total / batches * 1.1 + 0.01 * math.cos(epoch)
            improved = val < best
            if improved:
                best, best_epoch, bad = val, epoch, 0
            else:
                bad += 1
            counters = Counters(batch=step, step=step, global_step=step, epoch=epoch + 1, epoch_step=batches)
            log.append(ValidationDone(epoch=epoch, metrics={"val_loss": val}, examples=1000, step=step))
            log.append(EpochSummarized(epoch=epoch, metrics={"loss": total / batches}, examples=32.0 * batches,
                                       microbatches=batches, updates=batches, duration_s=1.0))
            log.append(MonitorDecided(epoch=epoch, monitor="val_loss", mode="min", value=val, improved=improved,
                                      best=best, best_epoch=best_epoch, bad_epochs=bad))
            log.append(SchedulerStepped(name="plateau", clock="epoch", epoch=epoch, step=step, steps=epoch + 1,
                                        lrs=[lr]))
            covers = log.append(HistoryAppended(record=HistoryRecord(
                epoch=epoch, train={"loss": total / batches}, val={"val_loss": val}, monitor_value=val,
                improved=improved, lrs={"adam": [lr]}, counters=counters, wall_time_s=1.0)))
            manifest = f"{epoch + 1:064x}"
            log.append(CheckpointStored(manifest=manifest, epoch=epoch, step=step, components={"model": manifest}))
            log.append(LastCommitted(manifest=manifest, epoch=epoch, step=step, counters=counters, covers=covers))
            if improved:
                log.append(BestCommitted(manifest=manifest, epoch=epoch, monitor="val_loss", value=val))
            commit()
        log.append(LastCommitted(manifest=manifest, epoch=epochs - 1, step=step, counters=counters, final=True))
        log.append(RunFinalized(status="completed", epochs=epochs, steps=step, wall_time_s=float(epochs)))
        commit()
        return log.next_seq


def replay_events_per_s(n_events: int = 500_000, batches: int | None = None) -> float:
    """Events per second to rebuild every projection from an LMDB log (read, decode, committed view, fold).

    ``batches=None``: the :func:`synthetic_log` (microbatches, receipts and a LAST per 250 of
    them); else a :func:`long_run_log` with ``batches`` microbatches an epoch (validation,
    summary, monitor decision, scheduler step, history, checkpoint, LAST, BEST each epoch).
    """
    root = Path(tempfile.mkdtemp(prefix="nnx_bench_replay_"))
    try:
        path = root / "run" / "events.lmdb"
        n = synthetic_log(path, n_events) if batches is None else long_run_log(path, n_events, batches)
        with LmdbLog(path, readonly=True) as log:
            t0 = time.perf_counter()
            p = project(log.read())
            dt = time.perf_counter() - t0
        assert p.counters.step > 0
        return n / dt
    finally:
        shutil.rmtree(root, ignore_errors=True)
