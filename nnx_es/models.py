"""Several models in one run (distillation): ``Trainer({"student": s, "teacher": t}, ...)``.

* :class:`ModelSet` holds the run's models by name. The **trainable** ones (those an optimizer
  holds parameters of) are its submodules, so every checkpoint holds each one's state under its
  name (``student.0.weight``) and the optimizers, devices and modes work as for one net. A
  **frozen** model (no optimizer holds any of its parameters: a teacher) is put in eval mode with
  ``requires_grad=False``, is kept out of the checkpoints, and is declared once in
  ``run_started.models`` by the SHA-256 of its state; a stateful resume with other frozen
  weights is refused before anything is restored (the teacher is verified, never re-stored).
  It follows the set's device moves and stays in eval mode when the set is put in train mode.
* :func:`multi_model_step` is the step a several-model run uses for training and validation:
  ``training_fn(models, batch) -> {key: tensor}`` makes the predictions (spec 004: the forward
  path's ``training_fn``); ``loss_target_assembler(loss, predictions, batch, *, workflow,
  target_keys) -> {key: tensor}`` makes the targets when they do not come from the batch (a
  teacher's outputs); without one, each target key is read from a mapping batch, or is the
  ``y`` of a ``(x, y)`` batch.
* :class:`Keyed` is a loss term that names the prediction and target keys it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from events.schema import ModelDecl
from nnx_es.errors import ConfigError
from nnx_es.evaluation import state_fingerprint
from nnx_es.objective import Term, batch_rows

__all__ = ["Keyed", "ModelSet", "batch_rows", "multi_model_step", "step_functions"]


class ModelSet(nn.Module):
    """The run's models by name: trainable ones as submodules, frozen ones beside them.

    Args:
        models: ``{name: module}``; names are identifiers.
        optimizers: the run's optimizers; a model none of them holds a parameter of is frozen.

    Raises:
        ConfigError: not a non-empty mapping of modules, a bad name, or no trainable model.
    """

    def __init__(self, models: Mapping[str, nn.Module], optimizers: Mapping[str, Optimizer]) -> None:
        super().__init__()
        if not isinstance(models, Mapping) or not models or not all(isinstance(m, nn.Module) for m in models.values()):
            raise ConfigError(f"models must be a non-empty {{name: nn.Module}}, got {models!r}")
        bad = [n for n in models if not (isinstance(n, str) and n.isidentifier())]
        if bad:
            raise ConfigError(f"model names must be identifiers, got {bad}")
        held = {id(p) for o in optimizers.values() for g in o.param_groups for p in g["params"]}
        self._frozen: dict[str, nn.Module] = {}
        for name, m in models.items():
            if any(id(p) in held for p in m.parameters()):
                self.add_module(name, m)
            else:
                m.requires_grad_(False)
                m.eval()
                self._frozen[name] = m
        if not any(True for _ in self.children()):
            raise ConfigError(f"no optimizer holds a parameter of any model {sorted(models)}: nothing would train")
        self._order = list(models)

    @property
    def models(self) -> dict[str, nn.Module]:
        """Every model by name, in the order given (what ``training_fn`` receives)."""
        own = dict(self.named_children())
        return {n: own.get(n) or self._frozen[n] for n in self._order}

    @property
    def frozen(self) -> dict[str, nn.Module]:
        return dict(self._frozen)

    def declare(self) -> dict[str, ModelDecl]:
        """``run_started.models``: each model's role and size; a frozen one's state by SHA-256."""
        out = {}
        for name, m in self.models.items():
            frozen = name in self._frozen
            out[name] = ModelDecl(frozen=frozen, parameters=sum(p.numel() for p in m.parameters()),
                                  sha256=state_fingerprint(m.state_dict()) if frozen else "")
        return out

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> ModelSet:
        super()._apply(fn, *args, **kwargs)
        for m in self._frozen.values():  # a frozen model follows the set's device and dtype moves
            m._apply(fn, *args, **kwargs)
        return self

    def train(self, mode: bool = True) -> ModelSet:
        super().train(mode)
        for m in self._frozen.values():
            m.eval()
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("a run of several models makes its predictions with training_fn(models, batch)")


class Keyed(Term):
    """A loss term reading ``predictions[prediction]`` and ``targets[target]`` (several-model runs).

    ``Keyed(nn.KLDivLoss(log_target=True), prediction="student", target="teacher")``; the term's
    loss follows :class:`~nnx_es.objective.Term` (one value per row, a torch loss unreduced).

    Raises:
        ConfigError: from a call, a key the predictions or targets do not have (named, with theirs).
    """

    def __init__(self, fn: Any, *, prediction: str, target: str, weight: Any = 1.0) -> None:
        super().__init__(fn, weight)
        self.prediction, self.target = prediction, target
        self.ignore_targets_key = target

    def ignore_targets(self, targets: Any) -> Any:
        """``targets[target]``: what an ``ignore_index`` (``CrossEntropyLoss``, ``NLLLoss``) is compared with,
        so its ignored targets count in no mean (None when the key is missing: the call names it)."""
        return targets.get(self.target) if isinstance(targets, Mapping) else targets

    def recipe_kwargs(self) -> dict[str, Any]:
        return {**super().recipe_kwargs(), "prediction": self.prediction, "target": self.target}

    def _pick(self, outputs: Any, targets: Any) -> tuple[Tensor, Tensor]:
        if not isinstance(outputs, Mapping) or self.prediction not in outputs:
            keys = sorted(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
            raise ConfigError(f"loss term reads prediction {self.prediction!r}; training_fn returned {keys}")
        if not isinstance(targets, Mapping) or self.target not in targets:
            keys = sorted(targets) if isinstance(targets, Mapping) else type(targets).__name__
            raise ConfigError(f"loss term reads target {self.target!r}; the targets are {keys}")
        return outputs[self.prediction], targets[self.target]

    def summed(self, outputs: Any, targets: Any) -> Tensor:
        return super().summed(*self._pick(outputs, targets))

    def per_row(self, outputs: Any, targets: Any) -> Tensor:
        return super().per_row(*self._pick(outputs, targets))


def multi_model_step(training_fn: Callable[..., Mapping[str, Tensor]], assembler: Callable[..., Mapping[str, Tensor]] | None,
                     objective: Any, target_keys: tuple[str, ...], workflow: str) -> Callable[[ModelSet, Any], Any]:
    """The ``(net, batch) -> (predictions, targets, None)`` step of a several-model run (module docstring).

    Raises (from the step):
        ConfigError: ``training_fn`` did not return a mapping of tensors, or a target cannot be read.
    """

    def step(models: ModelSet, batch: Any) -> tuple[Mapping[str, Tensor], Mapping[str, Tensor], None]:
        predictions = training_fn(models.models, batch)
        if not isinstance(predictions, Mapping):
            raise ConfigError(f"training_fn must return {{key: tensor}} predictions, got {type(predictions).__name__}")
        if assembler is not None:
            targets = assembler(objective, predictions, batch, workflow=workflow, target_keys=target_keys)
        elif isinstance(batch, Mapping):
            missing = [k for k in target_keys if k not in batch]
            if missing:
                raise ConfigError(f"targets {missing} are neither in the batch (keys {sorted(batch)}) nor made by a "
                                  "loss_target_assembler")
            targets = {k: batch[k] for k in target_keys}
        elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
            targets = {k: batch[1] for k in target_keys}
        else:
            raise ConfigError("a several-model run reads its targets from a mapping batch, a (x, y) batch, or a "
                              "loss_target_assembler")
        return predictions, targets, None

    return step


def step_functions(net: nn.Module, objective: Any, train_step_fn: Any, eval_step_fn: Any, training_fn: Any,
                   loss_target_assembler: Any, target_keys: Any) -> tuple[Any, Any]:
    """The Trainer's ``(train_step_fn, eval_step_fn)``: for a run of several models (``net`` a
    :class:`ModelSet`) made from ``training_fn`` and ``loss_target_assembler`` (the target keys:
    ``target_keys``, or those the :class:`Keyed` terms read); otherwise those given.

    Raises:
        ConfigError: several models without ``training_fn`` or with a ``train_step_fn`` /
            ``eval_step_fn``; one net with ``training_fn`` or ``loss_target_assembler``.
    """
    if isinstance(net, ModelSet):
        if training_fn is None or train_step_fn is not None or eval_step_fn is not None:
            raise ConfigError("a run of several models makes its predictions with training_fn(models, batch) -> "
                              "{key: tensor} (and its targets with loss_target_assembler); give training_fn, "
                              "and no train_step_fn / eval_step_fn")
        keys = tuple(dict.fromkeys(t.target for t in objective.terms.values() if isinstance(t, Keyed)))
        keys = tuple(target_keys) if target_keys is not None else keys
        return (multi_model_step(training_fn, loss_target_assembler, objective, keys, "train"),
                multi_model_step(training_fn, loss_target_assembler, objective, keys, "validate"))
    if training_fn is not None or loss_target_assembler is not None:
        raise ConfigError("training_fn / loss_target_assembler drive a run of several models: pass the models as "
                          "{name: module} (for one net, use train_step_fn)")
    return train_step_fn, eval_step_fn
