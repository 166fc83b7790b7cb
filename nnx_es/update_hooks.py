"""Update hooks and the one orchestrator that owns the replacement stages.

An :class:`UpdateHook` changes *whether or how* gradients are applied; it may
own ``DO_BACKWARD`` (replace ``loss.backward()``) and/or ``DO_OPTIMIZER_STEP``
(replace ``optimizer.step()``), veto a step (recorded as ``update_skipped``,
reason ``vetoed``), and act after a committed step. Only one hook may own each
replacement stage: a second owner is refused at construction (spec 004,
"Optimizer Orchestration").

Built-ins: :class:`GradientAccumulation`, :class:`GradientClipping`,
:class:`MixedPrecision` and :class:`EMA` (validation runs on the averaged
weights while an EMA is present).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from nnx_es.errors import ConfigError
from nnx_es.stages import TrainingStage
from nnx_es.argchecks import as_number

#: an averaging hook's name: it keys the checkpoint component ``update_hook/<name>``
_HOOK_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

if TYPE_CHECKING:
    from nnx_es.runtime.context import TrainContext
    from nnx_es.runtime.engine import UpdateEngine, UpdateSettings

__all__ = ["EMA", "GradientAccumulation", "GradientClipping", "MixedPrecision", "UpdateHook", "UpdateOrchestrator",
           "collect", "settings_of"]


class UpdateHook:
    """Base of update hooks: every method is a no-op; ``owns`` lists replacement stages taken over."""

    owns: frozenset[TrainingStage] = frozenset()

    @property
    def name(self) -> str:
        return type(self).__name__

    def configure(self, engine: UpdateEngine) -> None:
        """Once, after the engine is built: read what the hook needs of it (the net, its GradScaler).
        The window size, clipping and precision are settings the engine is built with
        (:func:`settings_of` reads the built-in hooks), not written here."""

    def backward(self, ctx: TrainContext, total: Tensor) -> None:
        """``DO_BACKWARD`` when owned: backpropagate the microbatch numerator ``total`` (0-dim)."""

    def step(self, ctx: TrainContext, optimizers: dict[str, Optimizer]) -> None:
        """``DO_OPTIMIZER_STEP`` when owned: apply the (final, unscaled, clipped) gradients."""

    def veto(self, ctx: TrainContext) -> bool:
        """Return True to skip this window's update (recorded with reason ``vetoed``)."""
        return False

    def after_step(self, ctx: TrainContext) -> None:
        """After a committed update (``AFTER_OPTIMIZER_STEP``)."""

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class UpdateOrchestrator:
    """Folds update hooks into one owner of ``DO_BACKWARD`` and ``DO_OPTIMIZER_STEP``.

    Raises:
        ConfigError: two hooks own the same replacement stage, a hook is not an UpdateHook, or
            two :class:`EMA` hooks have the same name (their checkpoint components would collide).
    """

    def __init__(self, hooks: Sequence[UpdateHook]) -> None:
        self.hooks = list(hooks)
        owners: dict[TrainingStage, UpdateHook] = {}
        for h in self.hooks:
            if not isinstance(h, UpdateHook):
                raise ConfigError(f"update hooks must subclass nnx_es.UpdateHook, got {type(h).__name__}")
            for stage in h.owns:
                if stage in owners:
                    raise ConfigError(
                        f"{stage.name} has two owners: {owners[stage].name} and {h.name}; only one update hook "
                        "may own a replacement stage"
                    )
                owners[stage] = h
        averaging = [h.name for h in self.hooks if isinstance(h, EMA)]
        if len(set(averaging)) != len(averaging):
            raise ConfigError(
                f"averaging hook names must be unique (they key checkpoint state), got {averaging}; give each "
                "EMA its own name, e.g. EMA(0.9, name='ema_fast'), EMA(0.999, name='ema_slow')"
            )
        self.backward_owner = owners.get(TrainingStage.DO_BACKWARD)
        self.step_owner = owners.get(TrainingStage.DO_OPTIMIZER_STEP)
        self._vetoers = [h for h in self.hooks if type(h).veto is not UpdateHook.veto]
        #: whether any hook can veto a step (else :meth:`vetoed` need not be asked)
        self.can_veto = bool(self._vetoers)
        self._after = [h for h in self.hooks if type(h).after_step is not UpdateHook.after_step]
        #: whether any hook acts after a step (else :meth:`after_step` need not be called)
        self.has_after_step = bool(self._after)

    def vetoed(self, ctx: TrainContext) -> bool:
        """Ask every update hook (none is skipped, so each sees every window); True if any vetoes."""
        votes = [h.veto(ctx) for h in self._vetoers]
        return any(votes)

    def after_step(self, ctx: TrainContext) -> None:
        for h in self._after:
            h.after_step(ctx)

    def averaged_module(self) -> nn.Module | None:
        for h in self.hooks:
            if isinstance(h, EMA) and h.averaged is not None:
                return h.averaged.module
        return None


class GradientAccumulation(UpdateHook):
    """Accumulate ``steps`` microbatches per optimizer update (one accumulation window)."""

    def __init__(self, steps: int) -> None:
        if not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"GradientAccumulation steps must be an int >= 1, got {steps!r}")
        self.steps = steps


class GradientClipping(UpdateHook):
    """Clip the total gradient L2 norm to ``max_norm`` (after unscaling; the receipt keeps the pre-clip norm)."""

    def __init__(self, max_norm: float) -> None:
        value = as_number(max_norm)
        if not value > 0 or math.isinf(value):
            raise ConfigError(f"clip_grad_norm (GradientClipping max_norm) must be a number > 0, got {max_norm!r}")
        self.max_norm = value


class MixedPrecision(UpdateHook):
    """Autocast in ``dtype`` (``"bf16"`` or ``"fp16"``); fp16 adds a GradScaler.

    With fp16 it owns ``DO_BACKWARD`` (scaled backward) and ``DO_OPTIMIZER_STEP``
    (``scaler.step``, which skips a step whose gradients overflowed).
    """

    def __init__(self, dtype: str = "bf16", *, init_scale: float = 2.0**16) -> None:
        if dtype not in ("bf16", "fp16"):
            raise ConfigError(f"MixedPrecision dtype must be 'bf16' or 'fp16', got {dtype!r}")
        if not init_scale > 0:
            raise ConfigError(f"MixedPrecision init_scale must be > 0, got {init_scale!r}")
        self.dtype = dtype
        self.init_scale = float(init_scale)
        if dtype == "fp16":
            self.owns = frozenset({TrainingStage.DO_BACKWARD, TrainingStage.DO_OPTIMIZER_STEP})

    def configure(self, engine: UpdateEngine) -> None:
        self._engine = engine  # its GradScaler (which a user may replace before training)

    def backward(self, ctx: TrainContext, total: Tensor) -> None:
        self._engine.scaler.scale(total).backward()  # type: ignore[union-attr]

    def step(self, ctx: TrainContext, optimizers: dict[str, Optimizer]) -> None:
        for opt in optimizers.values():
            self._engine.scaler.step(opt)  # type: ignore[union-attr]


class EMA(UpdateHook):
    """An exponential moving average of the weights (``torch.optim.swa_utils.AveragedModel``).

    Updated after every committed update (``AFTER_OPTIMIZER_STEP``). Validation evaluates
    the averaged weights (spec 004, "Validation"), so the monitor, BEST, the plateau
    scheduler and early stopping decide on them. Each checkpoint holds them as the
    component ``update_hook/<name>`` (this ``AveragedModel``'s state dict) beside the raw
    weights in ``model``: a stateful resume restores the raw weights into the net and the
    averaged ones into this hook (spec 004: EMA weights are hook state; a ``weights_only``
    continuation, which restores no hook state, starts from the raw ones), while
    :meth:`nnx_es.nnmodel.NNModel.load` gives the averaged ones by default -- the weights
    that were scored -- and the raw ones with ``weights="raw"``.

    Several averages (``EMA(0.9, name="fast"), EMA(0.999, name="slow")``) need distinct
    ``name``s; the first one listed is the one validation evaluates. A stateful resume
    needs the run's averages: the same names in the same order (:mod:`nnx_es.runtime.session`).

    Raises:
        ConfigError: ``decay`` is not in (0, 1), or ``name`` is not 1-64 characters of
            ``[A-Za-z0-9._-]``.
    """

    def __init__(self, decay: float = 0.999, *, name: str = "EMA") -> None:
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"EMA decay must be in (0, 1), got {decay!r}")
        if not isinstance(name, str) or not _HOOK_NAME.fullmatch(name):
            raise ConfigError(f"EMA name must be 1-64 characters of [A-Za-z0-9._-], got {name!r}")
        self.decay = float(decay)
        self._name = name
        self.averaged: AveragedModel | None = None

    @property
    def name(self) -> str:
        """Keys the checkpoint component ``update_hook/<name>`` (default ``"EMA"``, the name of
        runs written before ``name=`` existed, so they resume unchanged)."""
        return self._name

    def configure(self, engine: UpdateEngine) -> None:
        self.averaged = AveragedModel(engine.net, multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=True)

    def after_step(self, ctx: TrainContext) -> None:
        assert self.averaged is not None
        self.averaged.update_parameters(ctx.net)

    def torch_state(self) -> dict[str, Any]:
        assert self.averaged is not None
        return self.averaged.state_dict()

    def load_torch_state(self, state: dict[str, Any]) -> None:
        assert self.averaged is not None
        self.averaged.load_state_dict(state)

    @staticmethod
    def module_state(state: Any) -> dict[str, Any] | None:
        """The averaged net's own state dict (the net's keys; tensors as stored, on CPU when
        loaded from a checkpoint) inside ``state``, a :meth:`torch_state` (``AveragedModel``
        state dict: ``module.<key>`` entries and the ``n_averaged`` count); None when
        ``state`` is not one."""
        if not isinstance(state, dict) or "n_averaged" not in state:
            return None
        return {k.removeprefix("module."): v for k, v in state.items()
                if isinstance(k, str) and k.startswith("module.")}


def collect(hooks: Iterable[Any]) -> tuple[list[UpdateHook], list[Any]]:
    """Split a mixed hook list into (update hooks, stage hooks)."""
    update, stage = [], []
    for h in hooks:
        (update if isinstance(h, UpdateHook) else stage).append(h)
    return update, stage


def settings_of(update_hooks: list[UpdateHook], *, accumulation: int = 1, clip_grad_norm: float | None = None,
                precision: str = "fp32", track_grad_norm: bool = False) -> tuple[list[UpdateHook], UpdateSettings]:
    """The update hooks with the Trainer's shortcut arguments added as hooks, and the engine's
    settings they give (the last hook of a kind decides; its defaults otherwise).

    Raises:
        ConfigError: a shortcut argument and a hook of its kind both given.
    """
    from nnx_es.runtime.engine import UpdateSettings

    update_hooks = list(update_hooks)
    for kwarg, value, default, cls in (("accumulation", accumulation, 1, GradientAccumulation),
                                       ("clip_grad_norm", clip_grad_norm, None, GradientClipping),
                                       ("precision", precision, "fp32", MixedPrecision)):
        if value != default and any(isinstance(h, cls) for h in update_hooks):
            raise ConfigError(f"{kwarg}={value!r} and a {cls.__name__} hook both configure the same thing; "
                              "give one of them")
    if accumulation != 1:
        update_hooks.append(GradientAccumulation(accumulation))
    if clip_grad_norm is not None:
        update_hooks.append(GradientClipping(clip_grad_norm))
    if precision != "fp32":
        update_hooks.append(MixedPrecision(precision))
    settings: dict[str, Any] = {"track_grad_norm": track_grad_norm}
    for h in update_hooks:
        if isinstance(h, GradientAccumulation):
            settings["accumulation"] = h.steps
        elif isinstance(h, GradientClipping):
            settings["clip_grad_norm"] = h.max_norm
        elif isinstance(h, MixedPrecision):
            settings["precision"], settings["init_scale"] = h.dtype, h.init_scale
    return update_hooks, UpdateSettings(**settings)
