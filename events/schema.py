"""The event vocabulary: one frozen, tagged msgspec Struct per lifecycle transition.

Conventions (STYLE.md):

* every event is ``frozen`` and ``kw_only``; the tag field is ``kind``;
* the tag of schema version 1 is the bare kind (``"epoch_began"``); a later
  version N is tagged ``"<kind>@N"``, and its predecessors stay in the union
  as legacy structs that :mod:`events.codec` upcasts at decode time;
* counters say their base: ``epoch`` is the 0-based index of an epoch,
  ``batch`` the 0-based index of a microbatch within its epoch, ``step`` the
  number of committed optimizer updates (so the first update is step 1);
* scalars carry units in their names (``wall_time_s``, ``examples``, ``lr``).

The lifecycle these events walk is declared in :mod:`nnx_es.lifecycle`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from events.base import Event
from events.commit_events import (  # re-exported: the commit group's events (a module of their own)
    BestCommitted,
    CallbackCheckpointed,
    CheckpointPruned,
    CheckpointStored,
    LastCommitted,
    PhaseCommitted,
)
from events.model_events import (  # re-exported: what is recorded of the model itself (a module of their own)
    DiagnosticsRecorded,
    EvaluationRecorded,
    ModelExported,
    ModelTransformed,
)
from events.values import (  # re-exported: the value types the events carry
    Counters,
    DigestCadence,
    HistoryRecord,
    Lineage,
    LoaderGeometry,
    ModelDecl,
    MonitorSpec,
    PlateauState,
    SchedulerDecl,
    SourceRef,
    Topology,
    UpdateSpec,
)

__all__ = [
    "BestCommitted",
    "CallbackBegan",
    "CallbackCheckpointed",
    "CallbackFinalized",
    "CheckpointPruned",
    "CheckpointStored",
    "Counters",
    "DiagnosticsRecorded",
    "DigestCadence",
    "EpochBegan",
    "EpochSummarized",
    "EvaluationRecorded",
    "Event",
    "HistoryAppended",
    "HistoryRecord",
    "LastCommitted",
    "Lineage",
    "LoaderGeometry",
    "MicrobatchDone",
    "ModelExported",
    "ModelTransformed",
    "ModelDecl",
    "MonitorDecided",
    "MonitorSpec",
    "ParamsDigested",
    "PhaseCommitted",
    "PlateauState",
    "RunFailed",
    "RunFinalized",
    "RunResumed",
    "RunStarted",
    "RowsRecorded",
    "JournalPublished",
    "SchedulerDecl",
    "SchedulerStepped",
    "SourceRef",
    "StopRequested",
    "Topology",
    "TrainBegan",
    "UpdateCommitted",
    "UpdateCommittedV1",
    "UpdateSkipped",
    "UpdateSpec",
    "ValidationDone",
    "WorldChanged",
]


# --- run lifecycle ---------------------------------------------------------------------


class RunStarted(Event, frozen=True, kw_only=True, tag="run_started"):
    """A new run began. ``recipe`` is the run's declared configuration (JSON-like)."""

    KIND: ClassVar[str] = "run_started"
    run_id: str
    seed: int
    recipe: dict[str, Any] = {}
    library_versions: dict[str, str] = {}
    callbacks: list[str] = []
    optimizers: list[str] = []
    schedulers: list[SchedulerDecl] = []
    monitor: MonitorSpec | None = None
    accumulation: int = 1
    update: UpdateSpec | None = None  # None: a run recorded before it was declared here
    world_size: int = 1
    writer_rank: int = 0
    source: SourceRef | None = None
    wall_time_s: float = 0.0
    #: each loader's geometry by role (``"train"``, ``"val"`` when given); None: a run recorded before it was
    loaders: dict[str, LoaderGeometry] | None = None
    #: the run's spec (``nnx_es.recipes.RunSpec`` as JSON: import paths and constructor keywords) when the
    #: trainer recorded one (``recipe_required=True``, the ``nnx-es`` CLI); None: none (and every older run)
    spec: dict[str, Any] | None = None
    #: SHA-256 of ``spec``'s canonical JSON (sorted keys); "" without a spec
    spec_hash: str = ""
    #: each loss term by name, as ``nnx_es.declare.describe_objective`` describes it (a stateful resume
    #: with another loss is refused); None: a run recorded before it was declared here
    objective: dict[str, str] | None = None
    #: the initial weights of a fine-tuning run (None: the net's own)
    lineage: Lineage | None = None
    #: each optimizer's parameter group names, in order (a group without a ``name`` is ``"group<i>"``);
    #: the receipts' ``lrs`` are in this order. None: a run recorded before it was declared here
    param_groups: dict[str, list[str]] | None = None
    #: the models of a several-model run by name (a frozen one by the hash of its state: a stateful
    #: resume with other frozen weights is refused); None: a run of one net
    models: dict[str, ModelDecl] | None = None
    #: the per-row history journal (``Trainer(history=...)``: ``"HistoryJournal(window=N, chunk_rows=M)"``,
    #: ``"none"`` without one; a stateful resume with another is refused); None: a run recorded before it was
    history: str | None = None
    #: when the ranks compare parameter digests (a data-parallel run); None: one process, or a run
    #: recorded before it was declared here
    digests: DigestCadence | None = None
    #: SHA-256 of the net's state when the run starts training from the net's own (or ``init_from``)
    #: weights (``nnx_es.evaluation.weights_fingerprint``: keys, dtypes, shapes, bytes): two runs that
    #: start from other weights differ here first. "": a run started from a source run's checkpoint
    #: (``source`` names it), and every run recorded before it was declared here
    initial_weights: str = ""


class RunResumed(Event, frozen=True, kw_only=True, tag="run_resumed"):
    """A stateful resume from LAST.

    ``[discard_from, discard_to)`` (sequence numbers) holds the uncommitted tail
    the resume abandons: those events stay in the log for audit and out of every
    projection. With a deferred LAST the range starts at the first event it left
    pending (after its ``covers``); that LAST and its group inside the range stay
    committed.
    """

    KIND: ClassVar[str] = "run_resumed"
    last_seq: int
    manifest: str
    epoch: int
    discard_from: int
    discard_to: int
    library_versions: dict[str, str] = {}
    callbacks: list[str] = []
    cleaned_temporaries: int = 0
    wall_time_s: float = 0.0
    #: the resumed session's digest cadence (``RunStarted.digests``; it may differ from the run's start)
    digests: DigestCadence | None = None


class WorldChanged(Event, frozen=True, kw_only=True, tag="world_changed"):
    """An elastic run (``nnx_es.distributed.elastic_loader``) goes on with another deal of its global
    batch: a resume (or a fork) on ``new`` ranks of a checkpoint trained on ``old`` ranks, or with
    another microbatch split. Right after ``run_resumed`` (or a fork's ``run_started``); committed
    by the resume's opening LAST (``nnx_es.distributed.resize``).

    global_batch: rows per committed update (G), the same on both sides. epoch: the 0-based epoch
    trained first on the new deal. rows_per_rank: G / new. microbatch_rows / accumulation: the new
    split of a rank's rows (microbatch_rows * accumulation = rows_per_rank). global_batches: updates
    per epoch (rows // G, on any world size). streams_kept: ranks that go on with their own RNG
    streams (min(old, new)); a rank >= old starts streams derived from the checkpoint.
    """

    KIND: ClassVar[str] = "world_changed"
    old: int
    new: int
    global_batch: int
    epoch: int
    rows_per_rank: int
    microbatch_rows: int
    accumulation: int
    global_batches: int
    streams_kept: int


class CallbackBegan(Event, frozen=True, kw_only=True, tag="callback_began"):
    """A callback's ``on_train_begin`` completed (``index`` is its list position)."""

    KIND: ClassVar[str] = "callback_began"
    name: str
    index: int


class TrainBegan(Event, frozen=True, kw_only=True, tag="train_began"):
    """The epoch loop starts at ``start_epoch`` (0-based) and ends before ``epochs``."""

    KIND: ClassVar[str] = "train_began"
    start_epoch: int
    epochs: int
    train_batches: int | None = None


class EpochBegan(Event, frozen=True, kw_only=True, tag="epoch_began"):
    KIND: ClassVar[str] = "epoch_began"
    epoch: int
    wall_time_s: float = 0.0


class MicrobatchDone(Event, frozen=True, kw_only=True, tag="microbatch_done"):
    """One microbatch's forward and backward.

    rows: rows in the microbatch; examples: its loss denominator (valid rows,
    or their weight sum); loss: numerator / denominator (``nan`` when the
    denominator is 0); terms: the same per named loss term.
    """

    KIND: ClassVar[str] = "microbatch_done"
    epoch: int
    batch: int
    rows: int
    examples: float
    loss: float
    terms: dict[str, float] = {}


class UpdateCommittedV1(Event, frozen=True, kw_only=True, tag="update_committed"):
    """Schema v1 of the step receipt: one learning rate, no clipping fields."""

    KIND: ClassVar[str] = "update_committed"
    VERSION: ClassVar[int] = 1
    step: int
    epoch: int
    microbatches: int
    examples: float
    loss: float
    lr: float
    optimizer: str = "default"


class UpdateCommitted(Event, frozen=True, kw_only=True, tag="update_committed@2"):
    """A committed optimizer update: the step receipt (spec 003, StepReceipt).

    step: committed updates after this one (1-based). microbatches: in the window
    (fewer than ``accumulation_steps`` for a short last window). local_examples /
    global_examples: loss denominator on this rank / summed over the data-parallel
    ranks (equal in one process). loss: window numerator / global denominator.
    grad_norm: total L2 norm before clipping (``None`` when not computed). lrs: the
    optimizer's learning rates, one per param group, as used by this step.
    data_parallel_size: ranks that took part (1 in one process). accumulation_steps:
    the configured microbatches per window. collective_bytes: bytes this rank's
    collectives moved for the window (gradient all-reduce, agreements, gathers; 0 in
    one process). skipped: spec 003's flag, always False here -- a window without an
    update is an ``update_skipped`` event, which carries the same accounting.
    Fields after ``precision`` were added in place (defaults: a receipt recorded
    before them decodes as one process's).
    """

    KIND: ClassVar[str] = "update_committed"
    VERSION: ClassVar[int] = 2
    step: int
    epoch: int
    microbatches: int
    local_examples: float
    global_examples: float
    loss: float
    grad_norm: float | None = None
    clipped: bool = False
    lrs: list[float] = []
    optimizer: str = "default"
    data_parallel_size: int = 1
    precision: str = "fp32"
    accumulation_steps: int = 1
    collective_bytes: int = 0
    skipped: bool = False
    #: each loss term's weight in this update's window, by name, when some weight follows a
    #: schedule (``nnx_es.loss_weights``); empty otherwise
    loss_weights: dict[str, float] = {}


class UpdateSkipped(Event, frozen=True, kw_only=True, tag="update_skipped"):
    """An accumulation window ended without an update.

    reason: ``masked`` (its denominator was 0), ``nonfinite`` (a loss or the
    gradient norm was not finite), ``vetoed`` (an update hook said no), or
    ``unreported`` (a custom ``trainer_step_fn`` recorded microbatches it never
    reported an update for, by the epoch's end).

    The window's accounting, as :class:`UpdateCommitted` has it (spec 003's receipt
    with ``skipped`` true): local_examples / global_examples (its denominator on
    this rank / over the ranks), data_parallel_size, accumulation_steps,
    collective_bytes. Defaults: a skip recorded before them decodes as one
    process's with an unknown (0) denominator.
    """

    KIND: ClassVar[str] = "update_skipped"
    step: int
    epoch: int
    microbatches: int
    reason: str
    optimizer: str = "default"
    detail: str = ""
    local_examples: float = 0.0
    global_examples: float = 0.0
    data_parallel_size: int = 1
    accumulation_steps: int = 1
    collective_bytes: int = 0


class ValidationDone(Event, frozen=True, kw_only=True, tag="validation_done"):
    """Validation metrics (``val_`` prefixed) over ``examples`` held-out rows.

    trigger: ``"epoch"`` (the epoch-cadence pass the monitor decides on),
    ``"steps"`` (a step-cadence pass, which makes no decision) or ``"final"`` (the pass
    once training ended, before finalization; no decision either).
    """

    KIND: ClassVar[str] = "validation_done"
    epoch: int
    metrics: dict[str, float]
    examples: int
    step: int = 0
    trigger: str = "epoch"


class EpochSummarized(Event, frozen=True, kw_only=True, tag="epoch_summarized"):
    """Whole-epoch training summary: metrics over every microbatch of the epoch."""

    KIND: ClassVar[str] = "epoch_summarized"
    epoch: int
    metrics: dict[str, float]
    examples: float
    microbatches: int
    updates: int
    skipped: int = 0
    duration_s: float = 0.0


class MonitorDecided(Event, frozen=True, kw_only=True, tag="monitor_decided"):
    """The epoch's one monitor decision (drives plateau, BEST and early stopping).

    bad_epochs: consecutive epochs without improvement, this one included.
    best / best_epoch: the best value so far and its epoch, after this decision.
    """

    KIND: ClassVar[str] = "monitor_decided"
    epoch: int
    monitor: str
    mode: str
    value: float
    improved: bool
    best: float
    best_epoch: int
    bad_epochs: int


class SchedulerStepped(Event, frozen=True, kw_only=True, tag="scheduler_stepped"):
    """A scheduler stepped on its clock. steps: its steps so far (1-based after this)."""

    KIND: ClassVar[str] = "scheduler_stepped"
    name: str
    clock: str
    epoch: int
    step: int
    steps: int
    lrs: list[float]
    plateau: PlateauState | None = None


class StopRequested(Event, frozen=True, kw_only=True, tag="stop_requested"):
    """Training will stop. reason: early_stopping | update_boundary | requested."""

    KIND: ClassVar[str] = "stop_requested"
    epoch: int
    step: int
    reason: str
    by: str = ""


# --- durable commits -------------------------------------------------------------------


class HistoryAppended(Event, frozen=True, kw_only=True, tag="history_appended"):
    KIND: ClassVar[str] = "history_appended"
    record: HistoryRecord


class RowsRecorded(Event, frozen=True, kw_only=True, tag="rows_recorded"):
    """One epoch's per-row records of one split, kept in the log (runs without a history journal).

    Written at the epoch's history step, before ``history_appended`` (so the epoch's LAST commits
    it; a crash before LAST leaves it in the ignored tail). One event per (epoch, split).

    epoch: 0-based. split: ``"train"`` or ``"val"``. rows: the number of records (count).
    columns: column name -> little-endian bytes of ``rows`` values, sorted by row id:
    ``row_id`` int64; ``loss``, ``prediction``, ``target``, ``confidence``, ``correct`` float32
    (see :mod:`nnx_es.rows` for what each holds).
    """

    KIND: ClassVar[str] = "rows_recorded"
    epoch: int
    split: str
    rows: int
    columns: dict[str, bytes]


class JournalPublished(Event, frozen=True, kw_only=True, tag="journal_published"):
    """The history journal's manifest for ``epoch`` is published (``HistoryJournal`` runs).

    Written at the epoch's history step, before ``history_appended``, after the epoch's chunk
    blobs and the manifest blob are durable. Readers trust it only once the epoch's LAST commits it.

    manifest: the SHA-256 (hex) of the manifest blob naming the epoch's chunks.
    previous: the manifest of the epoch before (``""`` for the run's first); the chain reaches
    every committed epoch. rows: records in the epoch (count, every split). chunks: chunk blobs.
    """

    KIND: ClassVar[str] = "journal_published"
    epoch: int
    manifest: str
    previous: str = ""
    rows: int = 0
    chunks: int = 0


class CallbackFinalized(Event, frozen=True, kw_only=True, tag="callback_finalized"):
    """A callback's ``on_train_end`` ran (``error`` names what it raised, if anything)."""

    KIND: ClassVar[str] = "callback_finalized"
    name: str
    index: int
    error: str | None = None


class RunFailed(Event, frozen=True, kw_only=True, tag="run_failed"):
    KIND: ClassVar[str] = "run_failed"
    error_type: str
    message: str
    epoch: int
    step: int
    traceback: str = ""


class RunFinalized(Event, frozen=True, kw_only=True, tag="run_finalized"):
    """The run ended. status: completed | stopped | failed."""

    KIND: ClassVar[str] = "run_finalized"
    status: str
    epochs: int
    steps: int
    wall_time_s: float = 0.0


class ParamsDigested(Event, frozen=True, kw_only=True, tag="params_digested"):
    """The ranks of a data-parallel run compared a digest of their parameters (issue 13, "Beyond the
    peers"): after ``step`` committed updates (1-based count) in 0-based ``epoch``.

    digests: each rank's digest (hex; index = rank), taken by every rank and gathered to all.
    diverged: the digests are not all equal. since_step: the step of the previous agreeing digest (0: none
    before): when ``diverged`` the ranks first differed after it, at or before ``step``.
    final: the comparison at the end of training (after the run's last commit), made when the cadence's
    last one did not fall on the final step (``digest_every`` beyond the run's updates, a stop at an
    update boundary): every completed or stopped run ends with its replicas compared.
    A disagreement stops the run (``run_failed`` follows); ``tools/replay`` checks every one.
    """

    KIND: ClassVar[str] = "params_digested"
    epoch: int
    step: int
    digests: list[str] = []
    diverged: bool = False
    since_step: int = 0
    final: bool = False


# --- after the run ---------------------------------------------------------------------
