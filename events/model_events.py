"""Events recorded of the model itself, beside the lifecycle: per-layer diagnostics at an epoch's end
(:mod:`nnx_es.diagnostics`), an evaluation of a checkpoint after the run
(:mod:`nnx_es.evaluation`), a transform applied to the net (:mod:`nnx_es.transforms`) and a verified
export after the run (:mod:`nnx_es.export`). Re-exported by :mod:`events.schema`; registered in
:mod:`events.codec` like every event."""

from __future__ import annotations

from typing import Any, ClassVar

from events.base import Event
from events.values import Topology

__all__ = ["DiagnosticsRecorded", "EvaluationRecorded", "ModelExported", "ModelTransformed"]


class DiagnosticsRecorded(Event, frozen=True, kw_only=True, tag="diagnostics_recorded"):
    """Per-layer training diagnostics of one committed update (``nnx_es.diagnostics.Diagnostics``).

    Written at the epoch's end (``on_epoch_end``, before ``history_appended``) for the updates of
    that epoch on the callback's cadence, so the epoch's LAST commits them and a crash before it
    leaves them in the ignored tail. Runs without the callback never write one.

    epoch: 0-based. step: committed updates after the recorded one (1-based, the receipt's ``step``).
    Keys are module paths (``"0"``, ``"encoder.fc1"``; ``"<root>"`` for the net's own parameters).
    grad_norm: L2 norm of a layer's gradients as its optimizer stepped with them (unscaled, the
    window's mean, after clipping). weight_norm: L2 norm of its parameters before the update.
    update_ratio: ``||after - before|| / ||before||`` of its parameters (dimensionless).
    activation_mean / activation_std: mean and standard deviation of an activation module's output
    on one training microbatch (the first after the previous committed update). dead_fraction:
    for ReLU-family modules, the fraction of units (channels: dim 1 of the output) not positive
    on any row of that microbatch.
    """

    KIND: ClassVar[str] = "diagnostics_recorded"
    epoch: int
    step: int
    grad_norm: dict[str, float] = {}
    weight_norm: dict[str, float] = {}
    update_ratio: dict[str, float] = {}
    activation_mean: dict[str, float] = {}
    activation_std: dict[str, float] = {}
    dead_fraction: dict[str, float] = {}


class ModelExported(Event, frozen=True, kw_only=True, tag="model_exported"):
    """One of the run's checkpoints was exported and the artifact verified, after the run was finalized.

    Appended (synced) behind ``run_finalized`` like :class:`EvaluationRecorded`, under the run's
    writer lease, by ``nnx-es export`` / ``NNModel.export(..., record=True)`` (``nnx_es.export``);
    it belongs to no commit and changes no projection. ``tools/replay`` checks that ``manifest``
    verifies and, when the file at ``path`` is present, that its SHA-256 is ``sha256`` -- for the latest
    ``model_exported`` naming that path only: a later export to the same path supersedes an earlier one.

    format: ``"onnx"``, ``"torch-export"`` or ``"safetensors"``. path: where the artifact was written
    (as given, resolved). sha256: the artifact's SHA-256 (hex). size_bytes: its size.
    checkpoint: ``"best"``, ``"last"`` or a LAST's seq (as text). manifest: that checkpoint's manifest
    SHA-256; epoch: its 0-based epoch. transforms: the transforms applied to the exported net, as
    recipe documents, in order. rows: rows of the sample batch the artifact was run on; sample: where
    they came from (``"validation"``: the run's recipe rebuilt its validation data; ``"given"``).
    atol / rtol: the tolerances (an output agrees when ``|a - b| <= atol + rtol * |b|``).
    max_abs_diff / max_rel_diff: the largest differences measured (``rel``: ``|a - b| / max(|b|, tiny)``).
    """

    KIND: ClassVar[str] = "model_exported"
    format: str
    path: str
    sha256: str
    checkpoint: str
    manifest: str
    epoch: int
    size_bytes: int = 0
    transforms: list[dict[str, Any]] = []
    rows: int = 0
    sample: str = "given"
    atol: float = 0.0
    rtol: float = 0.0
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    wall_time_s: float = 0.0


class ModelTransformed(Event, frozen=True, kw_only=True, tag="model_transformed"):
    """A model transform (``nnx_es.transforms``: pruning, low-rank adapters, a new head, dynamic
    quantization) was applied to the run's net.

    transform: the transform's recipe (``{"@type": "recipe", "target", "kwargs"}``). index: its
    0-based position in the net's list of applied transforms (the checkpoint's
    ``topology.transforms``). epoch: the 0-based epoch at whose boundary it was applied (-1:
    before training). origin: ``"trainer"`` (``Trainer(transforms=...)``), ``"callback"`` (a
    callback at an epoch boundary: ``TransformAt``) or ``"checkpoint"`` (rebuilt on a fresh net
    from the topology of the checkpoint a resume restored). before / after: the net's topology.
    Emitted after the session's opening event for the first two kinds' rebuilds, or where the
    callback applied it.
    """

    KIND: ClassVar[str] = "model_transformed"
    transform: dict[str, Any]
    index: int
    epoch: int
    origin: str
    before: Topology
    after: Topology


class EvaluationRecorded(Event, frozen=True, kw_only=True, tag="evaluation_recorded"):
    """One of the run's checkpoints was evaluated on a whole loader, after the run was finalized.

    Appended (and synced) behind ``run_finalized``, under the run's writer lease, by
    ``NNModel.evaluate(..., record=...)``; it belongs to no commit and changes no projection,
    so every commit invariant of the run holds as before. A later stateful resume discards it
    from the committed view like any tail, and it stays in the log for the audit.

    name: the caller's label of the data (``"test"``). checkpoint: ``"best"`` or ``"last"``.
    manifest: that checkpoint's manifest SHA-256 (hex; verified before evaluating).
    epoch: its 0-based epoch. weights: which of its weights were evaluated (``"evaluated"``,
    ``"raw"``, ``"averaged"``: see ``NNModel.load``). metrics: unprefixed (``loss``,
    ``accuracy``, ...), each exact over the loader's rows. examples: rows scored (count).
    """

    KIND: ClassVar[str] = "evaluation_recorded"
    name: str
    checkpoint: str
    manifest: str
    epoch: int
    weights: str = "evaluated"
    metrics: dict[str, float] = {}
    examples: int = 0
    wall_time_s: float = 0.0
