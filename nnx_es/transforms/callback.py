"""Transforms during a run: :class:`TransformAt` (a callback applying one at an epoch boundary), the
checks ``Trainer(transforms=...)`` makes, and the ``model_transformed`` events a session reports.

A transform applied at the end of epoch E (``on_epoch_end``: after the epoch's validation and monitor
decision, before its history and LAST) is in E's checkpoint, whose topology lists it; one applied at
the beginning of epoch E (``on_epoch_begin``) trains in E. Either way the epoch's LAST holds the net it
recorded, so a process killed anywhere resumes bitwise: from an earlier LAST the callback applies it
again at the same boundary; from E's LAST or later the resume rebuilds it on the fresh net
(:func:`nnx_es.transforms.core.pending`) and the callback, keyed by the epoch alone, does not fire again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.optim import Optimizer

from events.schema import ModelTransformed
from nnx_es.callbacks import Callback
from nnx_es.errors import ConfigError
from nnx_es.transforms.core import Transform, applications, apply_transforms, document, extend

__all__ = ["TransformAt", "check_trained", "opening_events", "prepare"]


class TransformAt(Callback):
    """Apply ``transform`` to the run's net at the ``"end"`` (default) or ``"begin"`` of 0-based ``epoch``.

    Only a transform that keeps every parameter the optimizers hold (``Prune``) may be applied during
    training; the others change the parameters and are declared before the optimizer is built
    (``Trainer(transforms=[...])``). Several ``TransformAt`` callbacks need distinct ``name``\\ s (gradual
    pruning: ``TransformAt(2, Prune(amount=0.3), name="prune2")``, ``TransformAt(4, ..., name="prune4")``).

    Raises:
        ConfigError: ``epoch`` is not an int >= 0, ``when`` is neither ``"end"`` nor ``"begin"``, or
            ``transform`` is not recordable or changes parameters (named); when training begins, a
            ``transform`` that would refuse the net (a target matching no layer), before any update.
    """

    distributed = "all"  # every rank transforms its replica alike, at the same boundary

    def __init__(self, epoch: int, transform: Transform, when: str = "end", name: str = "TransformAt") -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"TransformAt: epoch must be a 0-based int >= 0, got {epoch!r}")
        if when not in ("end", "begin"):
            raise ConfigError(f"TransformAt: when must be 'end' or 'begin', got {when!r}")
        document(transform)  # recordable, or refused now
        if not transform.keeps_parameters:
            raise ConfigError(
                f"TransformAt: {transform!r} changes the net's parameters, which the run's optimizers were built "
                "over: apply it before training, Trainer(transforms=[...]); during training only a transform that "
                "keeps every parameter (Prune) may be applied")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"TransformAt: name must be a non-empty string, got {name!r}")
        self.epoch, self.transform, self.when, self._name = epoch, transform, when, name

    @property
    def name(self) -> str:
        return self._name

    def recipe_kwargs(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "transform": self.transform, "when": self.when, "name": self._name}

    def on_train_begin(self, ctx: Any) -> None:
        """Refuse, before any training, a transform that would refuse the net at its epoch
        (:meth:`Transform.check`): a wrong target found epochs into a run would waste them."""
        self.transform.check(ctx.net)

    def _fire(self, ctx: Any) -> None:
        (done,) = extend(ctx.net, [self.transform], origin="callback", epoch=ctx.epoch)
        ctx.state.recorder.emit(_event(done, len(applications(ctx.net)) - 1))

    def on_epoch_begin(self, ctx: Any) -> None:
        if self.when == "begin" and ctx.epoch == self.epoch:
            self._fire(ctx)

    def on_epoch_end(self, ctx: Any) -> None:
        if self.when == "end" and ctx.epoch == self.epoch:
            self._fire(ctx)


def _event(done: Any, index: int) -> ModelTransformed:
    return ModelTransformed(transform=done.transform, index=index, epoch=done.epoch, origin=done.origin,
                            before=done.before, after=done.after)


def opening_events(net: nn.Module) -> list[ModelTransformed]:
    """One ``model_transformed`` per transform ``net`` carries, in order: what a session reports after its
    opening event (the trainer's own, and those a resume rebuilt from its checkpoint)."""
    return [_event(done, i) for i, done in enumerate(applications(net))]


def prepare(net: Any, transforms: Sequence[Transform]) -> list[Transform]:
    """``Trainer(transforms=...)``: apply them to ``net`` (keeping a prefix it already carries); return them.

    Raises:
        ConfigError: ``transforms`` is not a list of transforms, ``net`` is several models, or see
            :func:`~nnx_es.transforms.core.apply_transforms`.
    """
    if isinstance(transforms, Transform) or not isinstance(transforms, Iterable):
        raise ConfigError(f"transforms must be a list of nnx_es.transforms transforms, got {transforms!r}")
    transforms = list(transforms)
    if transforms and (isinstance(net, Mapping) or not isinstance(net, nn.Module)):
        raise ConfigError("transforms act on one net; a run of several models takes none (transform the "
                          "models themselves before training)")
    if transforms:
        apply_transforms(net, transforms, origin="trainer")
    return transforms


def check_trained(net: nn.Module, optimizers: Mapping[str, Optimizer]) -> None:
    """Refuse a transformed net with a trainable parameter no optimizer holds (built before the transform).

    Raises:
        ConfigError: naming the parameters and how to build the optimizer.
    """
    if not applications(net):
        return
    held = {id(p) for o in optimizers.values() for g in o.param_groups for p in g["params"]}
    orphans = [n for n, p in net.named_parameters() if p.requires_grad and id(p) not in held]
    if orphans:
        raise ConfigError(
            f"the transformed net has trainable parameters no optimizer holds: {orphans[:8]}"
            f"{' ...' if len(orphans) > 8 else ''}; build the optimizer after the transforms: "
            "net = nnx_es.transforms.apply_transforms(net, transforms), then Adam(p for p in net.parameters() if "
            "p.requires_grad), and pass the same transforms= (or NNModel.train(transforms=..., optimizer=factory))")
