"""Typed decisions: typed questions in, validated typed answers out, each traceable to a checkpoint.

A question is a msgspec Struct; a :class:`DecisionProvider` answers a batch of them. The
provider for a trained classifier is :class:`FixedHeadProvider`, over
:meth:`nnx_es.NNModel.predict_proba`: the class probabilities, the chosen label, and an
abstention when the top probability is below a threshold. A provider loaded from a run
(:meth:`FixedHeadProvider.from_run`: BEST or LAST, hash-verified before loading) carries the run
id and manifest hash it answers from, and so does every answer (spec 000, "Typed decisions").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
import torch
from torch import nn

from nnx_es.errors import ConfigError
from nnx_es.nnmodel import NNModel
from nnx_es.result import load_result

__all__ = ["ClassifyAnswer", "ClassifyQuestion", "DecisionProvider", "FixedHeadProvider", "Source"]


class ClassifyQuestion(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which class is ``features``? ``features``: one row of the model's input, a list of floats."""

    features: list[float]


class Source(msgspec.Struct, frozen=True, kw_only=True):
    """Where an answer comes from: the run, which checkpoint (``best``/``last``), its manifest hash and epoch."""

    run_id: str
    checkpoint: str
    manifest: str
    epoch: int


class ClassifyAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """``probabilities``: one per class, summing to 1; ``label``: the most probable class, or None when
    ``abstained`` (its probability ``confidence`` is below the provider's threshold)."""

    probabilities: list[float]
    label: int | None
    confidence: float
    abstained: bool
    source: Source | None = None


class DecisionProvider(Protocol):
    """Answers a batch of typed questions, one answer each, in order."""

    def decide(self, questions: Sequence[Any]) -> list[Any]: ...


class FixedHeadProvider:
    """Classifies with a fixed model head (``NNModel.predict_proba``).

    Args:
        model: the :class:`~nnx_es.NNModel` (or an ``nn.Module`` of ``(N, F)`` -> ``(N, C)`` logits).
        n_features: the input width ``F`` every question must have.
        threshold: abstain when the top probability is below it (0 never abstains), in [0, 1].
        source: the checkpoint the weights came from (set by :meth:`from_run`).

    Raises:
        ConfigError: a bad ``n_features`` or ``threshold``.
    """

    def __init__(self, model: NNModel | nn.Module, *, n_features: int, threshold: float = 0.0,
                 source: Source | None = None) -> None:
        self.model = model if isinstance(model, NNModel) else NNModel(model)
        if isinstance(n_features, bool) or not isinstance(n_features, int) or n_features < 1:
            raise ConfigError(f"n_features must be an int >= 1, got {n_features!r}")
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"threshold must be in [0, 1], got {threshold!r}")
        self.n_features, self.threshold, self.source = n_features, float(threshold), source

    @classmethod
    def from_run(cls, model: NNModel | nn.Module, run_dir: str | Path, which: str = "best", *, n_features: int,
                 threshold: float = 0.0, weights_of: str | None = None) -> FixedHeadProvider:
        """Load ``run_dir``'s BEST or LAST weights into ``model`` (manifest and blobs hash-verified
        first, :meth:`NNModel.load`) and answer from them. ``weights_of``: in a run of several
        models, the one whose weights to load (``NNModel.load(model=...)``).

        Raises:
            ConfigError / CheckpointUnavailableError / CorruptCheckpointError: see :meth:`NNModel.load`.
        """
        nn_model = model if isinstance(model, NNModel) else NNModel(model)
        epoch = nn_model.load(run_dir, which, model=weights_of)
        loaded = nn_model.source
        assert loaded is not None  # load succeeded
        source = Source(run_id=load_result(run_dir).run_id, checkpoint=which, manifest=loaded.manifest, epoch=epoch)
        return cls(nn_model, n_features=n_features, threshold=threshold, source=source)

    def validate(self, questions: Sequence[Any]) -> list[ClassifyQuestion]:
        """Typed questions from questions or their builtins (dicts).

        Raises:
            ConfigError: naming the question's index and the field (``$.features``) of the wrong
                type, or of another length than ``n_features``.
        """
        out = []
        for i, q in enumerate(questions):
            try:
                q = q if isinstance(q, ClassifyQuestion) else msgspec.convert(q, ClassifyQuestion)
                q = msgspec.convert(msgspec.to_builtins(q), ClassifyQuestion)  # a Struct built by hand is checked too
            except msgspec.ValidationError as exc:
                raise ConfigError(f"question {i}: {exc}") from None
            if len(q.features) != self.n_features:
                raise ConfigError(f"question {i}: field `$.features` has {len(q.features)} values, expected "
                                  f"{self.n_features}")
            out.append(q)
        return out

    def decide(self, questions: Sequence[Any]) -> list[ClassifyAnswer]:
        """Answer a batch of questions (one forward pass), in order.

        Raises:
            ConfigError: a question of the wrong shape or type (see :meth:`validate`).
        """
        typed = self.validate(questions)
        if not typed:
            return []
        x = torch.tensor([q.features for q in typed], dtype=torch.float32)
        probs = self.model.predict_proba(x)
        answers = []
        for row in probs.tolist():
            top = max(range(len(row)), key=row.__getitem__)
            abstained = row[top] < self.threshold
            answers.append(ClassifyAnswer(probabilities=row, label=None if abstained else top, confidence=row[top],
                                          abstained=abstained, source=self.source))
        return answers
