"""NNModel: a classifier around an ``nn.Module``, trained through the Trainer."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from nnx_es.checkpoint import Manifest, load_component, verify_checkpoint
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.result import RunResult, load_result
from nnx_es.snapshot import weight_misfits
from nnx_es.storage import BlobStore
from nnx_es.trainer import Trainer
from nnx_es.update_hooks import EMA

__all__ = ["NNModel"]

#: the keyword arguments :meth:`NNModel.train` passes on to :class:`~nnx_es.trainer.Trainer`
_TRAINER_KEYWORDS = frozenset(
    name for name, p in inspect.signature(Trainer.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY
)

#: ``NNModel.load(weights=...)``: which weights of a checkpoint are loaded
_WEIGHTS = ("evaluated", "raw", "averaged")


def _averaged_state(store: BlobStore, manifest: Manifest) -> dict[str, Any] | None:
    """The averaged weights a checkpoint holds (its first ``update_hook/<name>`` component that
    is an :class:`~nnx_es.update_hooks.EMA` state: the hook validation evaluated), or None."""
    for name in manifest.components:
        if name.startswith("update_hook/"):
            weights = EMA.module_state(load_component(store, manifest, name))
            if weights is not None:
                return weights
    return None


class NNModel:
    """Wraps ``net`` (logits out, shape ``(N, C)``, or ``(N, 1)`` for a binary head) for training and prediction.

    Args:
        net: the module; ``net(x)`` maps ``(N, *features)`` float32 to ``(N, C)`` logits
            (C >= 2, softmax; train with ``CrossEntropyLoss``, the default), or to one logit
            ``(N, 1)`` of a binary classifier (sigmoid; train with ``loss=nn.BCEWithLogitsLoss()``
            on float 0/1 targets of shape ``(N, 1)``).
    """

    def __init__(self, net: nn.Module) -> None:
        if not isinstance(net, nn.Module):
            raise ConfigError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        self.net = net
        self.run: RunResult | None = None

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
        if optimizer is None:
            optimizer = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        elif not isinstance(optimizer, Optimizer):
            optimizer = optimizer(self.net.parameters())
        trainer = Trainer(self.net, optimizer, loss if loss is not None else nn.CrossEntropyLoss(), **trainer_kwargs)
        self.run = trainer.fit(train_loader, val_loader, epochs=epochs, resume_from=resume_from,
                               resume_mode=resume_mode, resume=resume)
        return self.run

    def load(self, run_dir: str | Path, which: str = "best", *, weights: str = "evaluated") -> int:
        """Load the weights of the run's BEST or LAST checkpoint (hash-verified); return its 0-based epoch.

        Args:
            which: ``"best"`` or ``"last"``.
            weights: which of the checkpoint's weights go into ``self.net``:
                ``"evaluated"`` (default): the ones validation scored -- the averaged
                weights when the run had an averaging update hook
                (:class:`~nnx_es.update_hooks.EMA`: validation, and so BEST, used them,
                spec 004 "Validation"), else the net's own; evaluated in eval mode on the
                same loader they reproduce the epoch's recorded validation metrics exactly.
                ``"raw"``: the net's own trained weights (component ``model``: what a
                stateful resume restores into the net, the averaged ones going back into
                the hook). ``"averaged"``: the averaged weights, refused when there are none.

        Raises:
            ConfigError: ``which`` or ``weights`` is not one of the values above, or the
                checkpoint's weights do not fit ``self.net`` (another architecture; the
                message names the keys only one side has and the shapes that differ).
            ResumeError: the run has no such checkpoint, or ``weights="averaged"`` and
                the checkpoint holds no averaged weights.
            CorruptCheckpointError: a manifest or blob does not verify.
        """
        if which not in ("best", "last"):
            raise ConfigError(f"which must be 'best' or 'last', got {which!r}")
        if weights not in _WEIGHTS:
            raise ConfigError(f"weights must be one of {', '.join(map(repr, _WEIGHTS))}, got {weights!r}")
        result = load_result(run_dir)
        pointer = result.best if which == "best" else result.last
        if pointer is None:
            raise ResumeError(f"run {result.run_id!r} has no committed {which.upper()} checkpoint")
        if pointer.manifest in result.pruned:
            raise ResumeError(f"the {which.upper()} checkpoint of run {result.run_id!r} (epoch {pointer.epoch}) was "
                              f"pruned by checkpoint retention ({result.pruned[pointer.manifest]}): train with "
                              "keep_best=True (the default) to keep BEST's, or keep_last=None to keep every one")
        store = BlobStore(Path(run_dir) / "blobs")  # reads manifests from the run's log, opened read-only
        manifest = verify_checkpoint(store, pointer.manifest)
        state = _averaged_state(store, manifest) if weights != "raw" else None
        if state is None and weights == "averaged":
            raise ResumeError(f"the {which.upper()} checkpoint of run {result.run_id!r} (epoch {pointer.epoch}) "
                              "holds no averaged weights: the run had no EMA update hook")
        state = state if state is not None else load_component(store, manifest, "model")
        misfits = weight_misfits(self.net, state)
        if misfits:
            raise ConfigError(f"the {which.upper()} checkpoint of run {result.run_id!r} (epoch {pointer.epoch}) "
                              f"does not fit this net (another architecture?): {misfits}")
        self.net.load_state_dict(state)
        return pointer.epoch

    @torch.no_grad()
    def predict_proba(self, x: Tensor) -> Tensor:
        """Class probabilities: ``x`` of shape ``(N, *features)`` float -> ``(N, C)`` float32, rows sum to 1.

        ``(N, C)`` logits give their softmax; one logit ``(N, 1)`` (a binary head) gives
        ``(N, 2)``: ``[1 - p, p]`` with ``p = sigmoid(logit)``, the probability of class 1.
        Runs in eval mode without gradients, on the model's device; returns on CPU.

        Raises:
            ValueError: the net's output is not 2-dimensional.
        """
        if not isinstance(x, Tensor):
            x = torch.as_tensor(x, dtype=torch.float32)
        was = self.net.training
        self.net.eval()
        try:
            device = next((p.device for p in self.net.parameters()), torch.device("cpu"))
            logits = self.net(x.to(device))
        finally:
            self.net.train(was)
        if logits.dim() != 2:
            raise ValueError(f"predict_proba expects logits of shape (N, C), the net returned {tuple(logits.shape)}")
        if logits.shape[1] == 1:  # a binary head: one logit
            p = torch.sigmoid(logits.float())
            return torch.cat([1.0 - p, p], dim=1).cpu()
        return torch.softmax(logits.float(), dim=-1).cpu()

    def predict(self, x: Tensor) -> Tensor:
        """Predicted class ids, shape ``(N,)`` int64: the most probable class (a binary head: 1 when
        its probability is > 0.5)."""
        return self.predict_proba(x).argmax(dim=-1)  # [1 - p, p]: 1 exactly when p > 0.5
