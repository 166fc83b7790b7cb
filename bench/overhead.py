"""Benchmark 1: training overhead against a hand-written loop and peer trainers.

The same workload for every contender: scikit-learn's digits (1,797 rows), an
MLP 64-128-10, Adam(lr=1e-3), batch 32, shuffled by a seeded generator, one
torch thread, a fixed number of epochs, no validation. nnx_es events every
microbatch and commits LAST each epoch. nnx_es runs three times: as a user gets it
(every default: LAST synced at each epoch's end, and ``batch_gather`` fetching
each batch of the in-memory ``TensorDataset`` with one gather per tensor -- the
same batches as the DataLoader, see ``nnx_es.data``); with ``batch_gather=False``,
iterating the DataLoader row by row like every other contender; and with
``checkpoint_lag="epoch"`` (each checkpoint persisted on a background thread while
the next epoch trains). The hand-written loop also runs twice, plain and fed by
the same gather, so each nnx_es row has a baseline that fetches batches as it
does (the trainer's own overhead). Contenders run interleaved (A B C D, A B C D,
...) so drift on a shared machine hits them alike.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["CONTENDERS", "EVENTS_ONLY", "FLOOR", "Timing", "clock", "since", "WIDE", "WORKLOAD", "digits_loader", "make_net", "run_floor", "run_hand_gathered", "run_nnx", "run_nnx_as_given",
           "run_nnx_lagged"]


class Timing(NamedTuple):
    """One run's time, seconds: ``wall`` (perf_counter) and ``cpu`` (process_time: the CPU time of
    every thread of the process, which a machine shared with other jobs disturbs far less than wall
    time; an fsync's wait is not CPU time)."""

    wall: float
    cpu: float


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(t0: tuple[float, float]) -> Timing:
    return Timing(time.perf_counter() - t0[0], time.process_time() - t0[1])


def digits_loader(seed: int = 0) -> DataLoader:
    x, y = load_digits(return_X_y=True)
    ds = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
    return DataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(seed))


#: the model of the runs: "mlp" (64-128-10, the overhead workload) or "wide" (64-1024-1024-10, compute dominates)
WORKLOAD = {"name": "mlp"}


def make_net() -> nn.Module:
    torch.manual_seed(0)
    if WORKLOAD["name"] == "wide":
        return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _atomic_save(obj: object, path: Path) -> None:
    """torch.save through an owned temporary file, fsync, atomic rename and a directory fsync."""
    import os

    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_hand_durable(epochs: int) -> Timing:
    """The hand-written loop saving a resumable checkpoint (model, optimizer, epoch) atomically each epoch."""
    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    root = Path(tempfile.mkdtemp(prefix="hand_bench_"))
    try:
        t0 = clock()
        for epoch in range(epochs):
            for x, y in loader:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(net(x), y)
                loss.backward()
                opt.step()
            _atomic_save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                          "rng": torch.get_rng_state(), "loader_rng": loader.generator.get_state()},
                         root / "last.pt")
        return since(t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_hand(epochs: int) -> Timing:
    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    t0 = clock()
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
    return since(t0)


def run_hand_gathered(epochs: int) -> Timing:
    """The hand-written loop fed by nnx_es's batch gather (the same batches): the fair baseline
    for the default nnx_es row."""
    from nnx_es.data import iterate_batches

    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    t0 = clock()
    for _ in range(epochs):
        for x, y in iterate_batches(loader):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
    return since(t0)


def run_nnx(epochs: int, *, batch_gather: bool = True, checkpoint_lag: int | str = 0) -> Timing:
    """nnx_es with every default (``batch_gather`` and ``checkpoint_lag`` can be changed)."""
    from nnx_es import Trainer

    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    root = Path(tempfile.mkdtemp(prefix="nnx_bench_"))
    try:
        trainer = Trainer(net, opt, nn.CrossEntropyLoss(), runs_root=root, run_id="bench", progress=False,
                          checkpoint_lag=checkpoint_lag, batch_gather=batch_gather)
        t0 = clock()
        trainer.fit(loader, epochs=epochs)
        return since(t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_floor(epochs: int, *, whole: bool = True, keep: Path | None = None) -> Timing:
    """The floor of the like-for-like target: the hand-written loop plus exactly the work the target
    asks of any implementation, with no trainer around it.

    Per microbatch: the gradients' fused finiteness check, the loss and the check read on the host
    (two ``.item()``), and two events (``microbatch_done``, ``update_committed``) encoded and
    appended to an LMDB event log. Per epoch: a checkpoint (model, optimizer, epoch) encoded with the
    ``"tensors"`` codec and hashed (SHA-256, which the audit verifies), its manifest staged in the
    log with ``checkpoint_stored`` and ``last_committed``, and one synced write. Nothing else: no
    lifecycle, counters, callbacks, receipts' accounting, metric sums, RNG capture or views. Its
    ratio bounds from below what nnx_es (or any trainer keeping these records) can reach here.

    ``whole=False``: the two events a microbatch only (no check, no read, no checkpoint; the
    update always steps): what recording alone costs inside a training loop. ``keep``: write the
    log and blobs there and leave them (for tests); by default a temporary directory, removed.
    """
    import math

    from events.log import LmdbLog
    from events.schema import CheckpointStored, LastCommitted, MicrobatchDone, UpdateCommitted
    from events.values import Counters
    from nnx_es.checkpoint import encode_checkpoint
    from nnx_es.state_codec import encode_state
    from nnx_es.storage import BlobStore

    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    params = list(net.parameters())
    found, one = torch.zeros(1), torch.ones(1)
    root = keep if keep is not None else Path(tempfile.mkdtemp(prefix="floor_bench_"))
    log = LmdbLog(root / "events.lmdb")
    store = BlobStore(root / "blobs", log)
    try:
        t0 = clock()
        step = batches = 0
        for epoch in range(epochs):
            for i, (x, y) in enumerate(loader):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(net(x), y)
                loss.backward()
                value, bad = 0.0, 0.0
                if whole:
                    torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params], found, one)
                    value, bad = loss.detach().item(), found.item()
                rows = len(y)
                batches += 1
                log.append(MicrobatchDone(epoch=epoch, batch=i, rows=rows, examples=float(rows), loss=value))
                if bad or not math.isfinite(value):
                    found.zero_()
                    continue
                opt.step()
                step += 1
                log.append(UpdateCommitted(step=step, epoch=epoch, microbatches=1, local_examples=float(rows),
                                           global_examples=float(rows), loss=value,
                                           lrs=[g["lr"] for g in opt.param_groups]))
            if not whole:
                log.flush()
                continue
            counters = Counters(batch=batches, step=step, global_step=step, epoch=epoch + 1)
            parts = {"model": ("tensors", encode_state(net.state_dict())),
                     "optimizer": ("tensors", encode_state(opt.state_dict()))}
            digest, manifest, data = encode_checkpoint(store, run_id="floor", epoch=epoch, step=step,
                                                       counters=counters, parts=parts)  # type: ignore[arg-type]
            store.stage(data, digest)
            log.append(CheckpointStored(manifest=digest, epoch=epoch, step=step,
                                        components={k: c.blob for k, c in manifest.components.items()}))
            log.append(LastCommitted(manifest=digest, epoch=epoch, step=step, counters=counters))
            log.flush(sync=True)
        return since(t0)
    finally:
        log.close()
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def run_ignite(epochs: int) -> Timing:
    from ignite.engine import create_supervised_trainer

    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    engine = create_supervised_trainer(net, opt, nn.CrossEntropyLoss())
    t0 = clock()
    engine.run(loader, max_epochs=epochs)
    return since(t0)


def run_ignite_durable(epochs: int) -> Timing:
    """Ignite with a ``Checkpoint`` (DiskSaver) of the model, optimizer and trainer each epoch."""
    from ignite.engine import Events, create_supervised_trainer
    from ignite.handlers import Checkpoint, DiskSaver

    net, loader = make_net(), digits_loader()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    engine = create_supervised_trainer(net, opt, nn.CrossEntropyLoss())
    root = tempfile.mkdtemp(prefix="ignite_bench_")
    try:
        handler = Checkpoint({"model": net, "optimizer": opt, "trainer": engine},
                             DiskSaver(root, require_empty=False), n_saved=1)
        engine.add_event_handler(Events.EPOCH_COMPLETED, handler)
        t0 = clock()
        engine.run(loader, max_epochs=epochs)
        return since(t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_lightning_durable(epochs: int) -> Timing:
    """Lightning with ``ModelCheckpoint(save_last=True)`` each epoch."""
    return run_lightning(epochs, durable=True)


def run_lightning(epochs: int, durable: bool = False) -> Timing:
    import logging
    import warnings

    import pytorch_lightning as pl

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()
            self.loss = nn.CrossEntropyLoss()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    root = tempfile.mkdtemp(prefix="pl_bench_")
    try:
        callbacks = []
        if durable:
            from pytorch_lightning.callbacks import ModelCheckpoint

            callbacks = [ModelCheckpoint(dirpath=root, save_last=True, every_n_epochs=1)]
        trainer = pl.Trainer(
            max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=durable,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, callbacks=callbacks,
        )
        module, loader = Module(), digits_loader()
        t0 = clock()
        trainer.fit(module, loader)
        return since(t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_events_only(epochs: int) -> Timing:
    """The hand-written loop appending two events a microbatch to an LMDB log (flushed each epoch): part of the floor."""
    return run_floor(epochs, whole=False)


def run_nnx_as_given(epochs: int) -> Timing:
    """nnx_es iterating the DataLoader row by row, as the other contenders do (its own overhead)."""
    return run_nnx(epochs, batch_gather=False)


def run_nnx_lagged(epochs: int) -> Timing:
    """nnx_es persisting each checkpoint on a background thread while the next epoch trains."""
    return run_nnx(epochs, checkpoint_lag="epoch")


#: the floor of the like-for-like target (:func:`run_floor`) and the part of it that is recording alone
FLOOR = ("the floor: hand-written loop + only the records the target asks for (two events a microbatch, the "
         "loss and the gradients' finiteness read, a checkpoint committed in the log each epoch), no trainer")
EVENTS_ONLY = "hand-written loop + two events a microbatch appended to the log (part of the floor)"

CONTENDERS: dict[str, Callable[[int], Timing]] = {
    "hand-written torch loop": run_hand,
    "hand-written torch loop, batches gathered": run_hand_gathered,
    "nnx_es": run_nnx,
    "nnx_es, batch_gather=False": run_nnx_as_given,
    "nnx_es, checkpoint_lag='epoch'": run_nnx_lagged,
    "hand-written torch loop + atomic torch.save each epoch": run_hand_durable,
    EVENTS_ONLY: run_events_only,
    FLOOR: run_floor,
    "pytorch-ignite": run_ignite,
    "pytorch-ignite + Checkpoint each epoch": run_ignite_durable,
    "pytorch-lightning": run_lightning,
    "pytorch-lightning + ModelCheckpoint(save_last) each epoch": run_lightning_durable,
}

#: the compute-dominated workload's contenders (WORKLOAD "wide"): the like-for-like rows
WIDE: dict[str, Callable[[int], Timing]] = {
    "hand-written torch loop": run_hand,
    "hand-written torch loop + atomic torch.save each epoch": run_hand_durable,
    "nnx_es, batch_gather=False": run_nnx_as_given,
}
