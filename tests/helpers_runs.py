"""Build realistic run directories event by event, for the audit and CLI tests.

:class:`RunBuilder` appends events the way the runtime does (each folded into
the projections as it goes, so counters and scheduler states in every manifest
match the log) and stores real checkpoints (a torch model blob, an optimizer
blob, msgpack ``counters`` and ``schedulers`` components) in the run's blob
store. :func:`clean_events` builds a clean two-epoch run; :func:`write_run`
writes a list of events to ``runs/<id>/events.lmdb`` and regenerates the views.

The clean run (two callbacks, optimizer ``sgd``, an optimizer_update-clock
``warmup`` scheduler, a plateau ``plateau`` scheduler on ``val_loss``)::

    run_started callback_began(logger#0) callback_began(saver#1) train_began
    checkpoint_stored last_committed(epoch -1)
    epoch 0: epoch_began mb mb update_committed scheduler_stepped(warmup)
             mb mb update_skipped validation_done epoch_summarized
             monitor_decided(improved) scheduler_stepped(plateau) history_appended
             checkpoint_stored last_committed best_committed callback_checkpointed
    epoch 1: epoch_began mb mb update_committed scheduler_stepped(warmup)
             mb mb update_committed scheduler_stepped(warmup) validation_done
             epoch_summarized monitor_decided(not improved) scheduler_stepped(plateau)
             history_appended checkpoint_stored last_committed phase_committed
             callback_checkpointed
    callback_finalized(saver#1) callback_finalized(logger#0) checkpoint_stored
    last_committed(final) run_finalized(completed)
"""

from __future__ import annotations

import pytest

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from events.log import LmdbLog
from events.schema import (
    BestCommitted,
    CallbackBegan,
    CallbackCheckpointed,
    CallbackFinalized,
    CheckpointStored,
    EpochBegan,
    EpochSummarized,
    Event,
    HistoryAppended,
    HistoryRecord,
    LastCommitted,
    MicrobatchDone,
    MonitorDecided,
    MonitorSpec,
    PhaseCommitted,
    PlateauState,
    RunFinalized,
    RunResumed,
    RunStarted,
    SchedulerDecl,
    SchedulerStepped,
    TrainBegan,
    UpdateCommitted,
    UpdateSkipped,
    ValidationDone,
)
from nnx_es.checkpoint import Manifest, torch_bytes, write_checkpoint
from nnx_es.storage import BlobStore
from nnx_es.views import write_views
from projections import Projections, fold, project

__all__ = ["RUN_ID", "Run", "RunBuilder", "build_clean_run", "clean_events", "copy_run", "find", "resumed_events",
           "write_run"]

RUN_ID = "r1"

SCHEDULERS = [
    SchedulerDecl(name="warmup", clock="optimizer_update", cls="LambdaLR", optimizer="sgd"),
    SchedulerDecl(name="plateau", clock="epoch", cls="ReduceLROnPlateau", optimizer="sgd", plateau=True),
]
MONITOR = MonitorSpec(name="val_loss", mode="min")
CALLBACKS = ["logger", "saver"]


@dataclass
class Run:
    """A written run: its directory, the events in its log, and its blob store."""

    run_dir: Path
    events: list[Event]
    store: BlobStore = field(repr=False)

    @property
    def log_path(self) -> Path:
        return self.run_dir / "events.lmdb"


class RunBuilder:
    """Appends events to a list, folding each into the projections (``self.p``) as the runtime would."""

    def __init__(self, run_dir: Path, run_id: str = RUN_ID) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.store = BlobStore(self.run_dir / "blobs")
        self.events: list[Event] = []
        self.p = Projections()
        self.lr = 0.1
        self.deferred: tuple[str, Manifest, bool, float, int] | None = None  # an epoch's LAST in flight
        self.best = math.inf
        self.best_epoch = -1
        self.bad = 0

    def add(self, event: Event) -> int:
        seq = len(self.events)
        self.events.append(event)
        self.p = fold(self.p, seq, event)
        return seq

    def scheduler_component(self) -> dict[str, object]:
        return {
            name: {"steps": s.steps, "lrs": list(s.lrs), "plateau": msgspec.to_builtins(s.plateau)}
            for name, s in self.p.schedulers.by_name.items()
        }

    def store_checkpoint(self, epoch: int) -> tuple[str, Manifest]:
        """Store a real checkpoint of the current state (no event); return (manifest hash, manifest)."""
        counters = self.p.counters
        weights = torch.full((2, 2), float(counters.step + 1))
        parts = {
            "model": ("torch", torch_bytes({"w": weights})),
            "optimizer/sgd": ("torch", torch_bytes({"state": {}, "param_groups": [{"lr": self.lr}]})),
            "counters": ("msgpack", msgspec.msgpack.encode(counters)),
            "schedulers": ("msgpack", msgspec.msgpack.encode(self.scheduler_component())),
        }
        return write_checkpoint(
            self.store, run_id=self.run_id, epoch=epoch, step=counters.step, counters=counters, parts=parts
        )

    def stored(self, digest: str, manifest: Manifest) -> None:
        self.add(CheckpointStored(manifest=digest, epoch=manifest.epoch, step=manifest.step,
                                  components={k: c.blob for k, c in manifest.components.items()}))

    def checkpoint(self, epoch: int) -> str:
        """Store a real checkpoint of the current state; append checkpoint_stored; return the manifest hash."""
        digest, manifest = self.store_checkpoint(epoch)
        self.stored(digest, manifest)
        return digest

    def last(self, epoch: int, *, final: bool = False) -> str:
        digest = self.checkpoint(epoch)
        c = self.p.counters
        self.add(LastCommitted(manifest=digest, epoch=epoch, step=c.step, counters=c, final=final))
        return digest

    # --- the run ------------------------------------------------------------------------

    def start(self, epochs: int = 2) -> None:
        self.add(RunStarted(run_id=self.run_id, seed=0, callbacks=CALLBACKS, optimizers=["sgd"],
                            schedulers=SCHEDULERS, monitor=MONITOR, accumulation=2))
        for i, name in enumerate(CALLBACKS):
            self.add(CallbackBegan(name=name, index=i))
        self.add(TrainBegan(start_epoch=0, epochs=epochs, train_batches=4))
        self.last(-1)

    def window(self, epoch: int, first_batch: int, *, skip: bool = False, stray_step: bool = False) -> None:
        """Two microbatches, then an update (and the warmup step) or a skipped update.

        stray_step: after a skipped update, step the warmup scheduler anyway (a bug).
        """
        for b in (first_batch, first_batch + 1):
            self.add(MicrobatchDone(epoch=epoch, batch=b, rows=8, examples=8.0, loss=1.0 / (b + 1)))
        step = self.p.counters.step
        if skip:
            self.add(UpdateSkipped(step=step, epoch=epoch, microbatches=2, reason="nonfinite"))
            if stray_step:
                warm = self.p.schedulers.by_name["warmup"]
                self.add(SchedulerStepped(name="warmup", clock="optimizer_update", epoch=epoch, step=step,
                                          steps=warm.steps + 1, lrs=[self.lr]))
            self.commit_deferred()
            return
        self.add(UpdateCommitted(step=step + 1, epoch=epoch, microbatches=2, local_examples=16.0,
                                 global_examples=16.0, loss=0.5, grad_norm=1.25, lrs=[self.lr], optimizer="sgd"))
        self.lr = round(self.lr * 0.9, 6)
        warm = self.p.schedulers.by_name["warmup"]
        self.add(SchedulerStepped(name="warmup", clock="optimizer_update", epoch=epoch, step=step + 1,
                                  steps=warm.steps + 1, lrs=[self.lr]))
        self.commit_deferred()

    def epoch(
        self, epoch: int, val_loss: float, *, skip_second: bool = False, stray_step: bool = False, defer: bool = False
    ) -> None:
        """One epoch; ``defer``: its LAST is written after the next epoch's first window (checkpoint lag)."""
        self.add(EpochBegan(epoch=epoch))
        self.window(epoch, 0)
        self.window(epoch, 2, skip=skip_second, stray_step=stray_step)
        val = {"val_loss": val_loss, "val_accuracy": 0.75}
        self.add(ValidationDone(epoch=epoch, metrics=val, examples=24, step=self.p.counters.step))
        train = {"loss": 0.5 - 0.1 * epoch, "accuracy": 0.5 + 0.1 * epoch}
        self.add(EpochSummarized(epoch=epoch, metrics=train, examples=32.0, microbatches=4,
                                 updates=1 if skip_second else 2, skipped=1 if skip_second else 0))
        improved = val_loss < self.best
        if improved:
            self.best, self.best_epoch, self.bad = val_loss, epoch, 0
        else:
            self.bad += 1
        self.add(MonitorDecided(epoch=epoch, monitor="val_loss", mode="min", value=val_loss, improved=improved,
                                best=self.best, best_epoch=self.best_epoch, bad_epochs=self.bad))
        plateau = self.p.schedulers.by_name["plateau"]
        self.add(SchedulerStepped(name="plateau", clock="epoch", epoch=epoch, step=self.p.counters.step,
                                  steps=plateau.steps + 1, lrs=[self.lr],
                                  plateau=PlateauState(best=self.best, num_bad_epochs=self.bad, cooldown_counter=0)))
        history = self.add(HistoryAppended(record=HistoryRecord(
            epoch=epoch, train=train, val=val, monitor_value=val_loss, improved=improved,
            lrs={"sgd": [self.lr]}, counters=self.p.counters, wall_time_s=0.5 + epoch,
        )))
        digest, manifest = self.store_checkpoint(epoch)
        if defer:
            self.deferred = (digest, manifest, improved, val_loss, history)
        else:
            self.commit(digest, manifest, improved, val_loss)

    def commit(self, digest: str, manifest: Manifest, improved: bool, val_loss: float, covers: int = -1) -> None:
        """An epoch's commit: checkpoint_stored, LAST, then its group (BEST, phase, callback checkpoint)."""
        epoch = manifest.epoch
        self.stored(digest, manifest)
        self.add(LastCommitted(manifest=digest, epoch=epoch, step=manifest.step, counters=manifest.counters,
                               covers=covers))
        if improved:
            self.add(BestCommitted(manifest=digest, epoch=epoch, monitor="val_loss", value=val_loss))
        if epoch == 1:
            self.add(PhaseCommitted(name="phase-1", manifest=digest, epoch=epoch))
        blob = self.store.put(f"logger state after epoch {epoch}".encode())
        self.add(CallbackCheckpointed(name="logger", epoch=epoch, blob=blob))

    def commit_deferred(self) -> None:
        if self.deferred is not None:
            digest, manifest, improved, val_loss, history = self.deferred
            self.deferred = None
            self.commit(digest, manifest, improved, val_loss, covers=history)

    def crash_in_epoch(self, epoch: int) -> None:
        """An epoch that begins and commits one update, then the process dies (an uncommitted tail)."""
        self.add(EpochBegan(epoch=epoch))
        self.window(epoch, 0)

    def resume(self) -> None:
        """A stateful resume from LAST: the tail since it is discarded, the projections rebuilt."""
        self.p = project(enumerate(self.events))
        last = self.p.checkpoints.last
        assert last is not None
        last_seq = max(i for i, e in enumerate(self.events) if isinstance(e, LastCommitted))
        n = len(self.events)
        self.add(RunResumed(last_seq=last_seq, manifest=last.manifest, epoch=last.epoch,
                            discard_from=last_seq + 1, discard_to=n, callbacks=CALLBACKS))
        self.p = project(enumerate(self.events))
        self.lr = self.p.schedulers.by_name["warmup"].lrs[0]
        for i, name in enumerate(CALLBACKS):
            self.add(CallbackBegan(name=name, index=i))
        self.add(TrainBegan(start_epoch=last.epoch + 1, epochs=2, train_batches=4))
        self.last(last.epoch)

    def finish(self, epochs: int = 2) -> None:
        for i in reversed(range(len(CALLBACKS))):
            self.add(CallbackFinalized(name=CALLBACKS[i], index=i))
        self.last(epochs - 1, final=True)
        self.add(RunFinalized(status="completed", epochs=epochs, steps=self.p.counters.step))


def clean_events(run_dir: Path) -> tuple[list[Event], BlobStore]:
    """The events of the clean two-epoch run; its blobs are stored under ``run_dir/blobs``."""
    b = RunBuilder(run_dir)
    b.start()
    b.epoch(0, val_loss=0.8, skip_second=True)
    b.epoch(1, val_loss=0.9)
    b.finish()
    return b.events, b.store


def resumed_events(run_dir: Path) -> list[Event]:
    """A run that crashed in epoch 1, resumed from epoch 0's LAST (the tail discarded) and finished clean."""
    b = RunBuilder(run_dir)
    b.start()
    b.epoch(0, val_loss=0.8)
    b.crash_in_epoch(1)
    b.resume()
    b.epoch(1, val_loss=0.7)
    b.finish()
    return b.events


def write_run(run_dir: Path, events: list[Event], *, views: bool = True) -> Run:
    """Write ``events`` (in order, seq 0..n-1) to ``run_dir/events.lmdb``; write the views of the log."""
    run_dir = Path(run_dir)
    with LmdbLog(run_dir / "events.lmdb") as log:
        for event in events:
            log.append(event)
        log.flush(sync=True)
    if views:
        write_views(run_dir, project(enumerate(events)))
    return Run(run_dir=run_dir, events=list(events), store=BlobStore(run_dir / "blobs"))


def build_clean_run(root: Path, run_id: str = RUN_ID) -> Run:
    """A clean two-epoch run under ``root/runs/<run_id>``."""
    run_dir = Path(root) / "runs" / run_id
    events, _ = clean_events(run_dir)
    return write_run(run_dir, events)


def copy_run(run: Run, root: Path) -> Run:
    """A copy of ``run`` under ``root/runs/<same id>`` (LMDB closed, so a file copy is consistent)."""
    dest = Path(root) / "runs" / run.run_dir.name
    shutil.copytree(run.run_dir, dest)
    return Run(run_dir=dest, events=list(run.events), store=BlobStore(dest / "blobs"))


def find(events: list[Event], kind: str, n: int = 0, **fields: object) -> int:
    """The seq of the ``n``-th event of ``kind`` whose fields equal ``fields``."""
    hits = [
        i for i, e in enumerate(events)
        if e.KIND == kind and all(getattr(e, k) == v for k, v in fields.items())
    ]
    return hits[n]


# fixtures shared by the audit and CLI tests (imported by name into those modules)
@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A clean, realistic 2-epoch run, built once per module."""
    return build_clean_run(tmp_path_factory.mktemp("template"))


@pytest.fixture
def clean(template: Run, tmp_path: Path) -> Run:
    """A private copy of the template run."""
    return copy_run(template, tmp_path)
