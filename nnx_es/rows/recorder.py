"""Recording per-row records during training and validation: :class:`RowRecorder`.

Per microbatch whose batch carries row ids (:func:`nnx_es.batches.row_ids_of`), the update
engine (training) and the validation pass (the epoch's own validation, not a
``validate_every_steps`` one) hand the batch's outputs and targets here; the row values
(:mod:`nnx_es.rows.columns`) are formed on the outputs' device and stay there -- no host read.
At the epoch's close (before ``on_epoch_end``) each split's values are read in one transfer,
sorted by row id and checked: a row id seen twice in one epoch's split (a sampler drawing with
replacement, a padded loader, a validation set scoring a row twice) fails the run, naming it,
because a record is keyed by ``(row id, epoch)``; so does an epoch mixing batches with and
without ids. Then ``ctx.idps`` shows them. At the epoch's history step (after the previous
epoch's LAST completed, before ``history_appended``, so the epoch's LAST commits them) they go
to the run: ``rows_recorded`` events in the log (one per split; fine for small runs), or, with
a :class:`~nnx_es.rows.journal.HistoryJournal`, chunks and a manifest (``journal_published``).

Under data parallelism (spec 000 §3 "Records and decisions": records are global, the same on
every rank) each rank records the rows of its own batches; at the epoch's close the ranks'
records are gathered (one all-gather of every rank's host arrays, :meth:`World.gather
<nnx_es.runtime.run_state.World.gather>`, only when the epoch's agreement said some rank recorded any),
so every rank checks, sorts and shows the union alike; every rank emits the same events, and the
writer alone writes them (and, with a journal, its chunks: the other ranks only name them, by
their SHA-256, and keep none). A resume's window comes from the writer (one broadcast per fit).
A row id on two ranks in one epoch is the repeat check above: a partition that pads
(``train_loader(policy="pad")`` when the world size does not divide the rows,
``DistributedSampler``) trains those rows twice.

Memory: without a journal every epoch's records stay in memory (they are the window); with
one, the newest ``window`` epochs, the one being closed included (and, during an epoch, its
records on the device).
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from events.schema import JournalPublished, RowsRecorded
from nnx_es.batches import row_ids_of
from nnx_es.errors import ConfigError
from nnx_es.objective import Objective, accuracy_kind, ignored_mask, row_losses
from nnx_es.rows.columns import SPLITS, VALUES, EpochRows, Part, RowView
from nnx_es.rows.journal import HistoryJournal, RunJournal, manifest_parts
from nnx_es.runtime.run_state import World

if TYPE_CHECKING:
    from events.log import EventLog
    from nnx_es.runtime.recording import Recorder
    from nnx_es.storage import BlobStore

#: one split of one rank's epoch, as read to the host: (row ids int64 (N,), values float32 (len(VALUES), N),
#: batches with ids, batches without)
_Local = tuple[np.ndarray, np.ndarray, int, int]

__all__ = ["RowRecorder", "row_values"]


def _kind(outputs: Tensor, targets: Any, objective: Objective) -> str:
    try:
        kind = accuracy_kind(outputs, targets)
    except ConfigError:
        return "regression"
    if kind == "binary":
        fns = [t.fn for t in objective.terms.values()]
        if any(isinstance(f, nn.BCELoss) for f in fns):
            return "binary_probability"  # the output is the probability itself
        if not any(isinstance(f, nn.BCEWithLogitsLoss) for f in fns):
            return "regression"  # one output scored by another loss than a binary cross-entropy
    return kind


def row_values(objective: Objective, outputs: Tensor, targets: Tensor) -> Tensor:
    """The row values of one batch: float32 ``(len(VALUES), B)`` on ``outputs``' device, no gradient.

    A classifier (:mod:`nnx_es.rows.columns`): ``(B, C)`` outputs with ``(B,)`` integer targets, or
    one logit ``(B, 1)`` under a ``BCEWithLogitsLoss`` term (one probability under ``BCELoss``); anything else with one output per row
    is a regression.

    Raises:
        ConfigError: outputs neither a classifier's nor one value per row (named with the shapes).
    """
    with torch.no_grad():
        out = outputs.detach()
        rows = out.shape[0]
        loss = row_losses(objective, out, targets).float().reshape(rows)
        kind = _kind(out, targets, objective)
        if kind == "multiclass":
            pred = out.argmax(dim=-1)
            # a target the loss ignores (its ignore_index) has no true label to score: NaN confidence and correct
            skip = ignored_mask(targets, objective.ignore)
            label = targets if skip is None else torch.where(skip, torch.zeros_like(targets), targets)
            conf = torch.log_softmax(out.float(), dim=-1).gather(1, label.reshape(-1, 1)).reshape(rows).exp()
            correct = (pred == targets).float()
            if skip is not None:
                conf = conf.masked_fill(skip, math.nan)
                correct = correct.masked_fill(skip, math.nan)
            pred, target = pred.float(), targets.float()
        elif kind in ("binary", "binary_probability"):
            logit = out.float().reshape(rows)
            target = targets.float().reshape(rows)
            p = torch.sigmoid(logit) if kind == "binary" else logit
            positive = target > 0.5
            conf = torch.where(positive, p, 1.0 - p)
            pred = ((logit > 0) if kind == "binary" else (p > 0.5)).float()
            correct = (pred == positive.float()).float()
        else:
            if not isinstance(targets, Tensor) or out[0].numel() != 1 or targets.numel() != rows:
                shape = tuple(getattr(targets, "shape", ()))
                raise ConfigError(
                    f"per-row records hold one prediction per row, but outputs of shape {tuple(out.shape)} against "
                    f"targets of shape {shape} are neither a classifier's ((B, C) logits with (B,) class ids, or one "
                    "logit (B, 1)) nor one output per row; yield batches without row ids ('idx') to train without "
                    "per-row records"
                )
            pred, target = out.float().reshape(rows), targets.detach().float().reshape(rows)
            conf = correct = torch.full((rows,), math.nan, dtype=torch.float32, device=out.device)
        return torch.stack([loss, pred, target.to(loss.device), conf, correct])


class RowRecorder:
    """Per-row records of one fit's run (see the module docstring), built once the run is open.

    The window and journal start from the run's committed records (a resume's; none for a new run):
    the writer reads them from ``log`` and ``store``; under data parallelism it hands every other rank
    what it read (one broadcast, on every rank), and the others' journal names its chunks without
    keeping them (:class:`~nnx_es.distributed.follower.NamingBlobStore`): only the writer's are read back.

    Args:
        objective: the run's loss (each row's ``loss`` is its unweighted total).
        journal: the history journal's settings (:class:`~nnx_es.rows.journal.HistoryJournal`), or
            ``None`` (records in the log; every epoch in memory).
        log / store / run_id: the run's event log, blob store and id.
        world: the process group (default: one process).
    """

    def __init__(self, objective: Objective, journal: HistoryJournal | None, log: EventLog, store: BlobStore,
                 run_id: str, *, world: World | None = None) -> None:
        from projections import committed

        self.objective = objective
        self.world = world = world or World()
        self._batches: dict[str, list[tuple[Tensor, Tensor]]] = {s: [] for s in SPLITS}
        self._plain = dict.fromkeys(SPLITS, 0)  # batches without ids, this epoch
        self.validating = False  # the epoch's own validation pass is running
        self.current: list[EpochRows] = []  # the epoch being closed (until its history step)
        self._window: deque[list[EpochRows]] = deque(maxlen=journal.window if journal else None)
        published: list[tuple[int, str]] = []
        window: list[list[EpochRows]] = []
        if world.is_writer:
            recorded: dict[int, list[EpochRows]] = {}
            if log.next_seq > 0:
                for _, event in committed(log.read()):
                    if type(event) is RowsRecorded:
                        recorded.setdefault(event.epoch, []).append(
                            EpochRows.decode(event.epoch, event.split, event.rows, event.columns))
                    elif type(event) is JournalPublished:
                        published.append((event.epoch, event.manifest))
            if journal is not None:
                window = [[p.load() for p in manifest_parts(store, digest)]
                          for _, digest in published[-journal.window:]]
            else:
                window = [recorded[e] for e in sorted(recorded)]
        if world.distributed:
            published, window = world.share((published, window) if world.is_writer else None)
        if journal is not None and not world.is_writer:
            from nnx_es.distributed.follower import NamingBlobStore

            store = NamingBlobStore(store.root)
        #: this run's journal (None: records in the log)
        self.journal: RunJournal | None = journal.open(store, run_id, published) if journal is not None else None
        self._window.extend(window)

    def _reset_epoch(self) -> None:
        for s in SPLITS:
            self._batches[s] = []
            self._plain[s] = 0

    # --- per batch (no host read) -------------------------------------------------------------

    def train_batch(self, batch: Any, outputs: Tensor, targets: Tensor) -> None:
        """A training microbatch (the step recorder calls :meth:`add` with ``"train"``)."""
        self.add("train", batch, outputs, targets)

    def val_batch(self, batch: Any, outputs: Tensor, targets: Tensor) -> None:
        """A validation batch (recorded during the epoch's own validation only)."""
        if self.validating:
            self.add("val", batch, outputs, targets)

    def add(self, split: str, batch: Any, outputs: Tensor, targets: Tensor) -> None:
        """One batch of ``split`` (``"train"`` or ``"val"``): its row values, when it carries row ids."""
        ids = row_ids_of(batch)
        if ids is None:
            self._plain[split] += 1
            return
        rows = outputs.shape[0]
        if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.shape[0] != rows or ids.is_floating_point() \
                or ids.dtype == torch.bool:
            got = f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
            raise ConfigError(f"a batch's row ids ('idx') must be integers of shape ({rows},), one per row, got {got}")
        self._batches[split].append((ids.detach(), row_values(self.objective, outputs, targets)))

    # --- per epoch ----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Batches with row ids recorded this epoch on this rank (the epoch's agreement sums them over the
        ranks: none anywhere, and :meth:`close_epoch` gathers nothing)."""
        return sum(len(b) for b in self._batches.values())

    def _local(self) -> dict[str, _Local]:
        """This rank's epoch per split, read to the host: one transfer per split that recorded rows."""
        out = {}
        for split in SPLITS:
            batches, plain = self._batches[split], self._plain[split]
            if batches:
                ids = torch.cat([b[0] for b in batches]).cpu().numpy().astype(np.int64, copy=False)
                values = torch.cat([b[1] for b in batches], dim=1).cpu().numpy()
            else:
                ids, values = np.empty(0, np.int64), np.empty((len(VALUES), 0), np.float32)
            out[split] = (ids, values, len(batches), plain)
        return out

    def close_epoch(self, epoch: int, *, gather: bool = False) -> None:
        """Read the epoch's records (one transfer per split), sort and check them; ``ctx.idps`` shows them.

        ``gather``: under data parallelism, some rank recorded rows this epoch (the epoch's agreement
        says so, alike on every rank): every rank's records are gathered (one all-gather, called on
        every rank), so every rank closes the union alike. Without it, this rank's records alone.

        Raises:
            ConfigError: a row id twice in one split (over every rank's), or batches with and without
                ids in one split (on any rank).
        """
        local = self._local()
        if gather and self.world.distributed:
            ranks: list[dict[str, _Local]] = self.world.gather(local)
            local = {split: (np.concatenate([r[split][0] for r in ranks]),
                             np.concatenate([r[split][1] for r in ranks], axis=1),
                             sum(r[split][2] for r in ranks), sum(r[split][3] for r in ranks)) for split in SPLITS}
        current = []
        where = f" (over the {self.world.size} ranks' batches)" if self.world.distributed else ""
        for split in SPLITS:
            ids, values, batches, plain = local[split]
            if not batches:
                continue
            if plain:
                raise ConfigError(
                    f"epoch {epoch}: {plain} {split} batches{where} carried no row ids while {batches} did; per-row "
                    "records need every batch of a loader to carry its rows' ids ('idx')")
            order = np.argsort(ids, kind="stable")
            ids, values = ids[order], values[:, order]
            if ids.shape[0] > 1:
                same = np.flatnonzero(ids[1:] == ids[:-1])
                if same.size:
                    row = int(ids[same[0]])
                    pad = (" -- under data parallelism a partition that pads trains some rows on two ranks: "
                           "nnx_es.distributed.train_loader(..., policy='drop'), or a row count the world size "
                           "divides" if self.world.distributed else "")
                    raise ConfigError(
                        f"epoch {epoch}: row id {row} was {'scored' if split == 'val' else 'trained'} more than once "
                        f"in the {split} split{where} ({same.size} repeated ids); a per-row record is keyed by (row "
                        "id, epoch): give every row a unique id and a loader that takes each row once per epoch (no "
                        f"sampling with replacement, no padding{pad})")
            current.append(EpochRows(epoch, split, ids, np.ascontiguousarray(values)))
        self._reset_epoch()
        self.current = current
        if current:
            self._window.append(current)  # the window holds the epoch being closed: at most `window` epochs

    def history_step(self, epoch: int, rec: Recorder) -> None:
        """Hand the epoch's records to the run (events or journal chunks), then move them into the window.

        Raises:
            CheckpointWriteError: a journal blob could not be written.
        """
        current = self.current
        if not current:
            return
        if self.journal is not None:
            rec.emit(self.journal.publish(epoch, current))
        else:
            for part in current:
                rec.emit(RowsRecorded(epoch=epoch, split=part.split, rows=part.rows, columns=part.encode()))
        self.current = []

    # --- views --------------------------------------------------------------------------------

    def window(self) -> RowView:
        """The records in memory: the window's epochs, the epoch being closed the newest of them."""
        return RowView([p for parts in self._window for p in parts])

    def full(self) -> RowView:
        """Every epoch of the run (a journal's lazily, from its chunks) and the epoch being closed."""
        if self.journal is None:
            return self.window()
        parts: list[EpochRows | Part] = [*self.journal.parts(), *self.current]
        return RowView(parts)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the records held on the host (the window and the epoch being closed)."""
        return sum(p.nbytes for parts in self._window for p in parts)


