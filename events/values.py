"""Value types carried inside events: counters, declarations and records that events embed.

Frozen, ``kw_only`` msgspec Structs with the conventions of :mod:`events.schema` (units in
field names, counters saying their base). They are not events (no tag); :mod:`events.schema`
re-exports them beside the events that carry them.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "Counters",
    "DigestCadence",
    "HistoryRecord",
    "Lineage",
    "LoaderGeometry",
    "ModelDecl",
    "MonitorSpec",
    "PlateauState",
    "SchedulerDecl",
    "SourceRef",
    "Topology",
    "UpdateSpec",
]


class Counters(msgspec.Struct, frozen=True, kw_only=True):
    """Progress counters (spec 004, "Training counters").

    batch: microbatches completed over the run (count).
    step: committed optimizer updates over the run (count).
    global_step: committed updates summed over data-parallel ranks (count).
    epoch: epochs completed (count; equals the next epoch's 0-based index).
    epoch_step: microbatches completed in the current epoch (count).
    """

    batch: int = 0
    step: int = 0
    global_step: int = 0
    epoch: int = 0
    epoch_step: int = 0


class MonitorSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The quantity one monitor decision per epoch is made on."""

    name: str
    mode: str = "min"
    min_delta: float = 0.0


class UpdateSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How the update engine makes each update: ``precision`` ``"fp32"`` | ``"bf16"`` | ``"fp16"``,
    ``clip_grad_norm`` the max total L2 norm (None: no clipping)."""

    precision: str = "fp32"
    clip_grad_norm: float | None = None


class SchedulerDecl(msgspec.Struct, frozen=True, kw_only=True):
    """A scheduler as declared at run start: its name, clock and torch class name."""

    name: str
    clock: str
    cls: str
    optimizer: str
    plateau: bool = False


class PlateauState(msgspec.Struct, frozen=True, kw_only=True):
    """The state of a plateau scheduler after a step (ReduceLROnPlateau semantics)."""

    best: float
    num_bad_epochs: int
    cooldown_counter: int


class LoaderGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of one loader's epoch, as far as the loader says (None where it does not).

    batch_size: rows per batch (a DataLoader's ``batch_size``; None with a batch sampler of its own).
    batches_per_epoch: ``len(loader)`` (count). drop_last: a DataLoader's ``drop_last``.
    dataset_length: ``len(loader.dataset)`` (rows).
    """

    batch_size: int | None = None
    batches_per_epoch: int | None = None
    drop_last: bool | None = None
    dataset_length: int | None = None


class DigestCadence(msgspec.Struct, frozen=True, kw_only=True):
    """When the ranks of a data-parallel run compare their parameter digests (``DDP(digest_every=)``,
    :mod:`nnx_es.distributed.digest`): after every ``every`` committed updates (at the steps that are its
    multiples), or, with ``every=None``, once per epoch after its last update. ``tools/replay`` checks
    that a ``params_digested`` was recorded at each of them."""

    every: int | None = None


class SourceRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where a continuation came from: source run, its LAST seq and manifest hash.

    state: what it took from there: ``"weights"`` (a ``weights_only`` continuation) or ``"full"``
    (a ``fork``: weights, optimizers, schedulers, RNG streams, callback state; a fresh monitor
    and counters).
    """

    run_id: str
    last_seq: int
    manifest: str
    state: str = "weights"


class Lineage(msgspec.Struct, frozen=True, kw_only=True):
    """Where a fine-tuning run's initial weights came from (``Trainer(init_from=WeightsFrom(...))``).

    kind: ``"run"`` (a run's checkpoint: ``run_id``, ``checkpoint`` best|last, its ``manifest``
    SHA-256 and 0-based ``epoch``) or ``"state_dict"`` (``state_sha256``: the fingerprint of the
    mapping given). strict: the key policy. skipped: source keys not loaded (absent from the net,
    or of another shape). new: the net's keys not loaded (they kept the net's own initialization).
    model: with a run of several models, the model whose weights were taken ("": the run's net as stored).
    """

    kind: str
    run_id: str = ""
    checkpoint: str = ""
    manifest: str = ""
    epoch: int = -1
    state_sha256: str = ""
    strict: bool = True
    skipped: list[str] = []
    new: list[str] = []
    model: str = ""


class ModelDecl(msgspec.Struct, frozen=True, kw_only=True):
    """One model of a several-model run (``Trainer({"student": s, "teacher": t}, ...)``).

    frozen: no optimizer holds its parameters (a teacher: eval mode, no gradients, kept out of
    the checkpoints). parameters: its parameter count. sha256: a frozen model's state
    fingerprint (``nnx_es.evaluation.state_fingerprint``), "" for a trainable one.
    """

    frozen: bool = False
    parameters: int = 0
    sha256: str = ""


class HistoryRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One committed epoch of history.

    train: whole-epoch training summary (``loss``, per-term losses, metrics).
    val: validation metrics (``val_loss``, ``val_accuracy``, ...); empty when
        the epoch was not validated.
    monitor_value / improved: the epoch's monitor decision, ``None`` when none was made.
    lrs: learning rates per optimizer after the epoch's scheduler steps.
    """

    epoch: int
    train: dict[str, float]
    val: dict[str, float]
    monitor_value: float | None = None
    improved: bool | None = None
    lrs: dict[str, list[float]] = {}
    counters: Counters = Counters()
    wall_time_s: float = 0.0


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    """A net's structure as a digest (``nnx_es.transforms.topology``): what a transform changed.

    sha256: hex SHA-256 over every module's dotted path and type, and every parameter's and
    buffer's name, shape and dtype, in registration order (weights' values are not hashed).
    modules: module count (the root included). parameters: parameter elements (count).
    trainable: elements of the parameters that require a gradient (count).
    """

    sha256: str
    modules: int = 0
    parameters: int = 0
    trainable: int = 0
