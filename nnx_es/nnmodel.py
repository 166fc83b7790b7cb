"""NNModel: a classifier around an ``nn.Module``, trained through the Trainer."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from msgspec import Struct
from torch import Tensor, nn
from torch.optim import Optimizer

from nnx_es.device import model_device
from nnx_es.errors import ConfigError, CorruptCheckpointError
from nnx_es.batches import weighted_forward
from nnx_es.runtime.engine import default_forward
from nnx_es.evaluation import (
    HEADS,
    evaluation_event,
    predict_outputs,
    record_evaluation,
    weights_fingerprint,
)
from nnx_es.metrics import evaluate as evaluate_pass
from nnx_es.metrics import check_accuracy, check_metric_names, validate_metrics
from nnx_es.user_metrics import bind_activation
from nnx_es.objective import Objective
from nnx_es.result import RunResult
from nnx_es.runtime.components import load_weights, weight_misfits
from nnx_es.trainer import Trainer
from nnx_es.transforms.core import Transform, apply_pending, apply_transforms, extend, pending, probe
from nnx_es.weights import fitting_models, model_names, read_topology, read_weights
from nnx_es.export import ExportReport, export_checkpoint, export_net

__all__ = ["NNModel", "WeightsSource"]

#: the keyword arguments :meth:`NNModel.train` passes on to :class:`~nnx_es.trainer.Trainer`
_TRAINER_KEYWORDS = frozenset(
    name for name, p in inspect.signature(Trainer.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY
)

class WeightsSource(Struct, frozen=True, kw_only=True):
    """Where the weights in an :class:`NNModel`'s net came from: a run's checkpoint.

    run_dir: the run. checkpoint: ``"best"`` or ``"last"``. manifest: its SHA-256. epoch: its
    0-based epoch. weights: which of its weights (see :meth:`NNModel.load`). fingerprint:
    :func:`~nnx_es.evaluation.weights_fingerprint` of the net right after they were put there.
    model: the model of a several-model run they are (None: the checkpoint's net as stored).
    """

    run_dir: str
    checkpoint: str
    manifest: str
    epoch: int
    weights: str
    fingerprint: str
    model: str | None = None


def _is_array(data: Any) -> bool:
    """A numpy array or nested lists of numbers (one input), as opposed to a loader."""
    if hasattr(data, "__array__"):
        return True
    return isinstance(data, list) and bool(data) and isinstance(data[0], (int, float, list))


def _classifier_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-row loss of an undeclared head: one logit ``(N, 1)`` -> binary cross-entropy with logits
    (targets 0/1, ``(N,)`` or ``(N, 1)``), ``(N, C)`` -> cross-entropy (class ids ``(N,)``)."""
    if outputs.dim() == 2 and outputs.shape[1] == 1:
        return nn.functional.binary_cross_entropy_with_logits(
            outputs[:, 0], targets.reshape(-1).to(outputs.dtype), reduction="none")
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


_classifier_loss.ignore_index = -100  # type: ignore[attr-defined]  # as CrossEntropyLoss: those targets count in no mean


def _default_loss(head: str) -> nn.Module:
    """The loss :meth:`NNModel.evaluate` scores a head with when none is given."""
    return {"multiclass": nn.CrossEntropyLoss, "binary": nn.BCEWithLogitsLoss, "regression": nn.MSELoss}[head]()


class NNModel:
    """Wraps ``net`` (logits out, shape ``(N, C)``, or ``(N, 1)`` for a binary head) for training and prediction.

    Args:
        net: the module; ``net(x)`` maps ``(N, *features)`` float32 to ``(N, C)`` logits
            (C >= 2, softmax; train with ``CrossEntropyLoss``, the default), or to one logit
            ``(N, 1)`` of a binary classifier (sigmoid; train with ``loss=nn.BCEWithLogitsLoss()``
            on float 0/1 targets of shape ``(N, 1)``), or to values of a regression.
        head: how outputs are read by :meth:`predict` and :meth:`evaluate`: ``"multiclass"``,
            ``"binary"`` or ``"regression"``; default ``None``: inferred from the outputs' shape
            (``(N, 1)``: binary, ``(N, C)``: multiclass) -- a one-output regression must say so.

    Raises:
        ConfigError: ``net`` is not a module, or ``head`` is not one of the above.
    """

    def __init__(self, net: nn.Module, *, head: str | None = None) -> None:
        if not isinstance(net, nn.Module):
            raise ConfigError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        if head is not None and head not in HEADS:
            raise ConfigError(f"head must be one of {', '.join(map(repr, HEADS))} or None (inferred), got {head!r}")
        self.net = net
        self.head = head
        self.run: RunResult | None = None
        #: the checkpoint the net's weights came from (set by :meth:`train` and :meth:`load`)
        self.source: WeightsSource | None = None
        #: the rank whose weights a group's :meth:`evaluate` compares the others' with (the last DDP train's writer)
        self._writer_rank = 0

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.net.parameters()

    def train(
        self,
        train_loader: Iterable[Any],
        val_loader: Iterable[Any] | None = None,
        *,
        epochs: int,
        optimizer: Optimizer | Callable[[Iterable[nn.Parameter]], Optimizer] | None = None,
        loss: Any = None,
        resume_from: str | Path | None = None,
        resume_mode: str = "stateful",
        resume: str | None = None,
        **trainer_kwargs: Any,
    ) -> RunResult:
        """Train with a :class:`~nnx_es.trainer.Trainer` and return the run.

        optimizer: an optimizer over ``self.parameters()``, or a factory called
        with them; default ``Adam(lr=1e-3)``. loss: default ``CrossEntropyLoss``.
        With a ``val_loader`` and no ``monitor``, the monitor is ``val_loss``
        (mode min), so the run has a BEST; ``metrics`` defaults to
        ``("accuracy",)`` (argmax of C logits, or one logit at probability 0.5; outputs or
        targets it cannot score are refused on the first batch: pass ``metrics=()`` for a
        regression). ``sample_weights=True`` reads a third batch element as per-row loss
        weights (:mod:`nnx_es.batches`). ``resume_from`` (a run directory ``runs/<id>``) and
        ``resume_mode`` (``"stateful"``: continue that run exactly from its LAST;
        ``"weights_only"``: a new run from its weights) and ``resume="auto"`` go to
        :meth:`~nnx_es.trainer.Trainer.fit`, which documents them: a stateful resume
        needs the run's recipe again (loaders with the same generators, the same optimizer,
        hooks, monitor...), and ``epochs`` counts from the run's start. The other keyword
        arguments go to :class:`~nnx_es.trainer.Trainer`.

        Raises:
            ConfigError: a keyword argument neither this method nor the Trainer takes
                (named, with the accepted ones), or a bad value (see the Trainer).
            ResumeError / LeaseHeldError: see :meth:`~nnx_es.trainer.Trainer.fit`.
        """
        unknown = sorted(set(trainer_kwargs) - _TRAINER_KEYWORDS)
        if unknown:
            raise ConfigError(
                f"NNModel.train got unknown keyword argument(s) {', '.join(map(repr, unknown))}; it takes "
                "epochs, optimizer, loss, resume_from, resume_mode, resume and the Trainer's "
                f"{', '.join(sorted(_TRAINER_KEYWORDS))}"
            )
        if val_loader is not None:
            trainer_kwargs.setdefault("monitor", "val_loss")
        trainer_kwargs.setdefault("metrics", ("accuracy",))
        if trainer_kwargs.get("transforms"):  # applied first: the optimizer is built over the transformed net
            apply_transforms(self.net, trainer_kwargs["transforms"], origin="trainer")
        if optimizer is None:
            optimizer = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        elif not isinstance(optimizer, Optimizer):
            optimizer = optimizer(self.net.parameters())
        trainer = Trainer(self.net, optimizer, loss if loss is not None else nn.CrossEntropyLoss(), **trainer_kwargs)
        self._writer_rank = getattr(trainer_kwargs.get("distributed"), "writer_rank", 0)
        self.run = trainer.fit(train_loader, val_loader, epochs=epochs, resume_from=resume_from,
                               resume_mode=resume_mode, resume=resume)
        last = self.run.last
        self.source = None if last is None else WeightsSource(
            run_dir=self.run.run_dir, checkpoint="last", manifest=last.manifest, epoch=last.epoch, weights="raw",
            fingerprint=weights_fingerprint(self.net))
        return self.run

    def load(self, run_dir: str | Path, which: str = "best", *, weights: str = "evaluated",
             model: str | None = None) -> int:
        """Load the weights of the run's BEST or LAST checkpoint (hash-verified); return its 0-based epoch.

        The transforms the checkpoint's net carried (:mod:`nnx_es.transforms`, its topology lists them) are
        rebuilt on ``self.net`` first, in order, unless it carries them already; ``self.net`` is then the
        transformed net (a pruned, adapted, re-headed or quantized one predicts as it did in training).

        Args:
            which: ``"best"``, ``"last"`` or the seq of one of the run's committed LASTs (an int).
            weights: which of the checkpoint's weights go into ``self.net``:
                ``"evaluated"`` (default): the ones validation scored -- the averaged
                weights when the run had an averaging update hook
                (:class:`~nnx_es.update_hooks.EMA`: validation, and so BEST, used them,
                spec 004 "Validation"), else the net's own; evaluated in eval mode on the
                same loader they reproduce the epoch's recorded validation metrics exactly.
                ``"raw"``: the net's own trained weights (component ``model``: what a
                stateful resume restores into the net, the averaged ones going back into
                the hook). ``"averaged"``: the averaged weights, refused when there are none.
            model: in a run of several models (``Trainer(net={"student": ..., ...})``), the one
                whose weights to load (``"student"``: its keys without the ``student.`` prefix);
                None (default): the checkpoint's keys as stored (:mod:`nnx_es.weights`).

        Raises:
            ConfigError: ``which`` or ``weights`` is not one of the values above, ``self.net`` carries
                transforms the checkpoint's net did not (named), or the checkpoint's weights do not fit ``self.net`` (another architecture; the
                message names the keys only one side has and the shapes that differ).
            CheckpointUnavailableError: the run has no such checkpoint, retention pruned it, or
                ``weights="averaged"`` and the checkpoint holds no averaged weights (was
                ``ResumeError``: nothing is resumed here).
            CorruptCheckpointError: a recorded transform cannot be re-applied (named); a manifest or blob does
                not verify, the manifest belongs to another run (mixed: its ``run_id`` is not the run's, as ``tools/replay`` and a resume refuse it),
                or a component does not decode (:mod:`nnx_es.state_codec`).
                Also a blob holding more bytes than its manifest records (read no further).
            EventLogError: the run's log cannot be read (damaged: named).
            UnsafePathError: the run's log, its blob directory or a blob is a symbolic link, a FIFO,
                a device, ...: refused, never followed or read (:mod:`events.paths`).
        """
        state, result, pointer = read_weights(run_dir, which, weights, model=model)
        todo = pending(self.net, read_topology(run_dir, pointer.manifest, result.run_id),
                       where=f"the {str(which).upper()} checkpoint of run {result.run_id!r}", training=False)
        misfits = weight_misfits(probe(self.net, todo), state)
        if misfits:
            names = model_names(state) if model is None else []
            fits = fitting_models(state, self.net.state_dict()) if model is None else []
            hint = (f"; its keys under {fits[0] + '.'!r} are this net's (a several-model run's {fits[0]!r}): "
                    f"load them with model={fits[0]!r}" if fits
                    else f"; the run stores several models ({', '.join(names)}): load one with model=<name>"
                    if len(names) > 1 and not set(names) & {n for n, _ in self.net.named_children()} else "")
            raise ConfigError(f"the {which.upper()} checkpoint of run {result.run_id!r} (epoch {pointer.epoch}) "
                              f"does not fit this net (another architecture?): {misfits}{hint}")
        apply_pending(self.net, todo)
        try:
            load_weights(self.net, state)
        except (RuntimeError, TypeError, ValueError, AttributeError) as exc:  # keys and shapes fit: crafted contents
            raise CorruptCheckpointError(f"the {which.upper()} checkpoint of run {result.run_id!r} (epoch "
                                         f"{pointer.epoch}) does not load into this net: {type(exc).__name__}: "
                                         f"{exc}") from None
        self.source = WeightsSource(run_dir=str(Path(run_dir)), checkpoint=str(which), manifest=pointer.manifest,
                                    epoch=pointer.epoch, weights=weights, fingerprint=weights_fingerprint(self.net),
                                    model=model)
        return pointer.epoch

    def transform(self, *transforms: Transform) -> NNModel:
        """Apply ``transforms`` (:mod:`nnx_es.transforms`) to ``self.net`` in place, in order; return ``self``.

        For inference (``Quantize()`` after :meth:`load`) or before :meth:`train` (which also takes
        ``transforms=``). The weights change, so an evaluation can no longer be recorded against the
        checkpoint they came from.

        Raises:
            ConfigError: a transform refuses the net, or is not recordable (named).
        """
        extend(self.net, transforms, origin="user")
        return self

    def export(self, out: str | Path, format: str = "onnx", *, sample: Any = None, rows: int = 64,
               atol: float | None = None, rtol: float | None = None, record: bool = True) -> ExportReport:
        """Export the net to ``out`` as ``format`` (``"onnx"``, ``"torch-export"`` or ``"safetensors"``), verified
        first: the artifact is run on a sample batch and compared with the net (:mod:`nnx_es.export`).

        Args:
            sample: the batch ``(N, *features)`` to verify on (a tensor or array); default: the first ``rows``
                rows of the validation data of the run the weights came from (its recorded data recipe rebuilt).
            atol / rtol: the tolerances (default per format: :data:`nnx_es.export.TOLERANCES`).
            record: append ``model_exported`` to the run the weights came from (:attr:`source`, after its
                ``run_finalized``); needs weights unchanged since :meth:`load` / :meth:`train`.

        Returns:
            the :class:`~nnx_es.export.ExportReport` (path, SHA-256, the differences measured).

        Raises:
            ConfigError: a bad format, path or tolerance, a missing optional package (``nnx_es[export]``), a
                quantized net, no sample to verify on, ``record`` without a source or with changed weights.
            ExportMismatchError: the artifact computes something else; nothing was written or recorded.
        """
        if sample is not None and not isinstance(sample, Tensor):
            sample = torch.as_tensor(sample, dtype=torch.float32)
        src = self.source
        if src is None:
            if record or sample is None:
                raise ConfigError("export: these weights name no checkpoint (train() or load() a run first), so "
                                  "there is no run to record into or to take a sample from: pass record=False and "
                                  "sample=")
            return export_net(self.net, sample, format, out, atol=atol, rtol=rtol)[0]
        if record and weights_fingerprint(self.net) != src.fingerprint:
            raise ConfigError(f"export(record=True): the net's weights changed since they were taken from the "
                              f"{src.checkpoint.upper()} of {src.run_dir}; the record would name a checkpoint that "
                              "is not what was exported (load() it again, or record=False)")
        return export_checkpoint(self.net, run_dir=src.run_dir, checkpoint=src.checkpoint, manifest=src.manifest,
                                 epoch=src.epoch, fmt=format, out=out, sample=sample, rows=rows, atol=atol,
                                 rtol=rtol, record=record)

    def outputs(self, data: Any) -> Tensor:
        """The net's raw outputs: ``data`` a tensor ``(N, *features)`` or a loader (every batch, in
        order: a tensor, ``(x, ...)`` or ``{"x": ...}``) -> ``(N, ...)`` float32 on the CPU.

        Eval mode (restored after), no gradients, on the model's device.
        """
        if not isinstance(data, Tensor) and _is_array(data):
            data = torch.as_tensor(data, dtype=torch.float32)
        return predict_outputs(self.net, [data] if isinstance(data, Tensor) else data, device=model_device(self.net))

    def predict_proba(self, data: Any) -> Tensor:
        """Class probabilities: ``data`` (a tensor ``(N, *features)`` or a loader, see :meth:`outputs`)
        -> ``(N, C)`` float32, rows sum to 1.

        ``(N, C)`` logits give their softmax; one logit ``(N, 1)`` (a binary head) gives
        ``(N, 2)``: ``[1 - p, p]`` with ``p = sigmoid(logit)``, the probability of class 1.
        Runs in eval mode without gradients, on the model's device; returns on CPU.

        Raises:
            ValueError: the net's output is not 2-dimensional, or the head is ``"regression"``.
        """
        if self.head == "regression":
            raise ValueError("predict_proba: a regression head has no class probabilities (use predict)")
        logits = self.outputs(data)
        if logits.dim() != 2:
            raise ValueError(f"predict_proba expects logits of shape (N, C), the net returned {tuple(logits.shape)}")
        if logits.shape[1] == 1:  # a binary head: one logit
            p = torch.sigmoid(logits)
            return torch.cat([1.0 - p, p], dim=1)
        return torch.softmax(logits, dim=-1)

    def predict(self, data: Any) -> Tensor:
        """Predictions for ``data`` (a tensor ``(N, *features)`` or a loader, see :meth:`outputs`).

        A classifier: class ids, shape ``(N,)`` int64, the most probable class (a binary head:
        1 when its probability is > 0.5). ``head="regression"``: the outputs, ``(N, ...)`` float32.
        """
        if self.head == "regression":
            return self.outputs(data)
        return self.predict_proba(data).argmax(dim=-1)  # [1 - p, p]: 1 exactly when p > 0.5

    def evaluate(self, loader: Iterable[Any], *, loss: Any = None, metrics: Any = None,
                 sample_weights: bool = False, record: bool = False, name: str = "eval") -> dict[str, float]:
        """Score the net on every row of ``loader``; return ``{"loss", <term>..., <metric>...}`` as floats.

        Each value is exact over the loader's rows (a ratio of sums, not a mean of batch means),
        computed in eval mode without gradients, on the model's device. Inside a process group
        of several ranks (torchrun) it is a collective: call it on every rank, each with its
        shard (``nnx_es.distributed.validation_loader``); the ranks' sums are all-reduced once and
        every rank returns the whole set's metrics (:func:`nnx_es.distributed.wrap.evaluation_world`),
        once a digest of every rank's weights has been agreed equal to the writer rank's (the last
        ``train(distributed=DDP(writer_rank=))``'s, else rank 0).
        A rank calling it alone waits for the others until the group's timeout, then raises. Batches follow the batch
        contract (:mod:`nnx_es.batches`; ``sample_weights=True`` reads a third element as row weights).

        Args:
            loss: default by head: ``CrossEntropyLoss`` (multiclass), ``BCEWithLogitsLoss``
                (binary: 0/1 targets, ``(N,)`` or ``(N, 1)``), ``MSELoss`` (regression); with no head
                declared, cross-entropy or binary cross-entropy by the outputs' shape. The loader
                is iterated once.
            metrics: as ``Trainer(metrics=...)``; default ``("accuracy",)`` for a classifier,
                none for a regression.
            record: also append the result to the run the weights came from (:attr:`source`, set by
                :meth:`train` and :meth:`load`) as an ``evaluation_recorded`` event after its
                ``run_finalized`` (why there: :mod:`nnx_es.evaluation`), labelled ``name``.

        Raises:
            ConfigError: a batch or outputs the loss or a metric refuses (named); in a group, loaders
                that would score a row twice over the ranks; outside one, a loader that is one rank's
                share of several (its metrics would be the share's); ``record=True``
                without a source, with weights changed since they were loaded or trained, or in a
                process that is one of several ranks (every rank would append the record, and only
                the writer rank writes the run: record from one process, without torchrun).
            DivergenceError: in a group, ranks whose weights differ from the writer rank's (e.g. the
                writer loaded BEST and the others did not), named on every rank; nothing was scored.
            ResumeError / LeaseHeldError: the source run is not finalized / is being written.
        """
        if record:
            from nnx_es.distributed.group import env_world_size

            if env_world_size() > 1:
                raise ConfigError(
                    f"evaluate(record=True) inside a group of {env_world_size()} ranks: the metrics are the whole "
                    "set's on every rank (the ranks' sums are agreed), but recording is not done inside a group: "
                    "every rank would append its own evaluation_recorded to the run, and only the writer rank may "
                    "write it (the others need not even see its directory); call evaluate(loader) without "
                    "record=True here for the metrics, and record from one process after the group ends (a script "
                    "run without torchrun: NNModel(net).load(run_dir, 'best'), then evaluate(a loader over the whole "
                    "data set, record=True)); nothing was scored or recorded")
        if record and self.source is None:
            raise ConfigError("evaluate(record=True) records into the run the weights came from: train() or "
                              "load() a run first (these weights name no checkpoint)")
        if record and weights_fingerprint(self.net) != self.source.fingerprint:  # type: ignore[union-attr]
            raise ConfigError(f"evaluate(record=True): the net's weights changed since they were taken from the "
                              f"{self.source.checkpoint.upper()} of {self.source.run_dir}; the record would name "  # type: ignore[union-attr]
                              "a checkpoint that is not what was scored (load() it again)")
        forward = weighted_forward if sample_weights else default_forward
        head = self.head
        if metrics is None:
            metrics = () if head == "regression" else ("accuracy",)
        if loss is None:  # no head declared: the outputs' shape says which, batch by batch (the loader is read once)
            loss = _default_loss(head) if head is not None else _classifier_loss
        objective = loss if isinstance(loss, Objective) else Objective(loss)
        declared = validate_metrics(metrics)
        check_metric_names(objective, declared)
        check_accuracy(objective, declared)
        bind_activation(declared, (t.fn for t in objective.terms.values()))
        from nnx_es.distributed.wrap import evaluation_world

        # a group of several ranks: the whole set's sums on every rank, once the ranks' weights are agreed equal
        world = evaluation_world(loader, self.net, writer_rank=self._writer_rank)
        values, rows = evaluate_pass(self.net, loader, objective, forward, declared, device=model_device(self.net),
                                     world=world)
        result = {k.removeprefix("val_"): v for k, v in values.items()}
        if record:
            src = self.source
            assert src is not None
            record_evaluation(src.run_dir, evaluation_event(
                name=name, checkpoint=src.checkpoint, manifest=src.manifest, epoch=src.epoch, weights=src.weights,
                metrics=result, examples=rows))
        return result
